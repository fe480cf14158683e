# Compiler flags shared by every Tessera target, the precompiled LibTorch headers they
# reuse, and the helpers the folders' CMakeLists call (tessera_target_defaults,
# tessera_parallel_loops).
set(TESSERA_WARNINGS -Wall -Wextra -Wno-unused-parameter)
if(TESSERA_WERROR)
  list(APPEND TESSERA_WARNINGS -Werror)
endif()

set(TESSERA_SANITIZE_FLAGS "")
if(TESSERA_SANITIZE)
  string(REPLACE "," ";" _san_list "${TESSERA_SANITIZE}")
  foreach(_san IN LISTS _san_list)
    if(NOT _san MATCHES "^(address|undefined)$")
      message(FATAL_ERROR "TESSERA_SANITIZE: unknown sanitizer '${_san}' (address, undefined)")
    endif()
  endforeach()
  set(TESSERA_SANITIZE_FLAGS -fsanitize=${TESSERA_SANITIZE} -fno-omit-frame-pointer)
  add_compile_options(${TESSERA_SANITIZE_FLAGS})
  add_link_options(${TESSERA_SANITIZE_FLAGS})
endif()

# Precompiled headers. LibTorch's headers are most of what a translation unit parses: about
# 8 of its 10-25 s on the 2-core machine. They are compiled once per kind of target (each
# kind has its own flags: -fPIC for libraries, -fopenmp for those with parallel loops, the
# default PIE of executables; the tests add GoogleTest) by a target that owns nothing else,
# and every target of that kind reuses them (REUSE_FROM). A mismatch GCC notices only costs
# speed: -Winvalid-pch says so and the headers are parsed as text. TESSERA_PCH=OFF builds
# without them, which also checks that every file includes what it uses.
option(TESSERA_PCH "Precompile LibTorch's headers once for all targets" ON)
set(TESSERA_PCH_HEADERS <ATen/ATen.h> <torch/nn/module.h> <string> <vector> <map> <memory>)
# Creates tessera_pch_<kind> (OBJECT, `pic`: its position-independent code setting) with the
# headers and options given.
function(tessera_pch_target kind pic)
  cmake_parse_arguments(ARG "" "" "HEADERS;OPTIONS;LIBRARIES" ${ARGN})
  add_library(tessera_pch_${kind} OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch_anchor.cpp)
  set_target_properties(tessera_pch_${kind} PROPERTIES POSITION_INDEPENDENT_CODE ${pic})
  target_compile_options(tessera_pch_${kind} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${TESSERA_WARNINGS}> -Winvalid-pch ${ARG_OPTIONS})
  target_link_libraries(tessera_pch_${kind} PRIVATE ${TORCH_LIBRARIES} ${ARG_LIBRARIES})
  target_precompile_headers(tessera_pch_${kind} PRIVATE ${TESSERA_PCH_HEADERS} ${ARG_HEADERS})
endfunction()
if(TESSERA_PCH AND NOT TESSERA_BUILD_FUZZ)  # the fuzz build has its own (fuzz/CMakeLists.txt)
  tessera_pch_target(lib ON)
  # Programs parse their command line with CLI11 (another 10 s a file).
  tessera_pch_target(exe OFF HEADERS <CLI/CLI.hpp> LIBRARIES CLI11::CLI11)
  if(TARGET OpenMP::OpenMP_CXX)
    tessera_pch_target(omp ON OPTIONS ${OpenMP_CXX_FLAGS})
  endif()
endif()
# Unity builds: each target's sources are compiled in batches, one compiler run per batch
# instead of per file. A run spends 3 s loading the precompiled headers (400 MB of
# LibTorch's declarations) before it reads a line of ours, and a batch parses Tessera's
# headers and instantiates nlohmann-json's templates once for all its files. The files of a
# batch share their anonymous namespaces, so a helper two files would each define lives in
# one header (common/clock.h, common/errors.h's firstLine, ...). TESSERA_UNITY=OFF compiles
# file by file: an edit then recompiles its file alone, not its batch.
option(TESSERA_UNITY "Compile each target's sources in batches (CMake unity builds)" ON)
set(TESSERA_UNITY_BATCH 8 CACHE STRING "Source files per unity batch")
if(TESSERA_UNITY)
  set(CMAKE_UNITY_BUILD ON)
  set(CMAKE_UNITY_BUILD_BATCH_SIZE ${TESSERA_UNITY_BATCH})
endif()

# `target` (a library or program that compiles against LibTorch) reuses the precompiled
# headers of its kind.
function(tessera_reuse_pch target kind)
  if(TESSERA_PCH AND TARGET tessera_pch_${kind})
    set_target_properties(${target} PROPERTIES PRECOMPILE_HEADERS_REUSE_FROM tessera_pch_${kind})
    target_compile_options(${target} PRIVATE -Winvalid-pch)
  endif()
endfunction()

# For a library whose sources call at::parallel_for: compiled with OpenMP, so that the
# loops run on LibTorch's intra-op threads (at::get_num_threads(), through the libgomp
# LibTorch itself loads) instead of one.
function(tessera_parallel_loops target)
  if(TARGET OpenMP::OpenMP_CXX AND TESSERA_TORCH_GOMP)
    # Compiled for OpenMP, linked to the libgomp LibTorch loads (its GOMP_* symbols).
    target_compile_options(${target} PRIVATE ${OpenMP_CXX_FLAGS})
    target_link_libraries(${target} PRIVATE ${TESSERA_TORCH_GOMP})
  elseif(TARGET OpenMP::OpenMP_CXX)
    target_link_libraries(${target} PRIVATE OpenMP::OpenMP_CXX)
  endif()
  tessera_reuse_pch(${target} omp)  # -fopenmp changes what ATen's headers declare
endfunction()

# Applies Tessera's warnings to a target (third-party headers are SYSTEM includes) and,
# unless it says NO_LIBTORCH (it compiles without LibTorch: tessera_common, tessera-run),
# the precompiled LibTorch headers of its kind.
# Installed, the headers live in <prefix>/include/tessera/<folder>/ (nothing of Tessera's
# lands in <prefix>/include itself): the package's users reach them as "<folder>/x.h",
# as Tessera's own headers include each other, or as <tessera/<folder>/x.h>.
function(tessera_target_defaults target)
  cmake_parse_arguments(ARG "NO_LIBTORCH" "" "" ${ARGN})
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${TESSERA_WARNINGS}>)
  if(NOT ARG_NO_LIBTORCH)
    get_target_property(type ${target} TYPE)
    if(type STREQUAL "EXECUTABLE")
      tessera_reuse_pch(${target} exe)
    else()
      tessera_reuse_pch(${target} lib)
    endif()
  endif()
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<INSTALL_INTERFACE:include/tessera>
    $<INSTALL_INTERFACE:include>)
endfunction()
