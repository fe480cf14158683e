# Compiler flags shared by every Tessera target, and the helper that declares a
# folder's library: tessera_add_library(<name> SOURCES ... DEPS ...).
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
endfunction()

# Applies Tessera's warnings to a target (third-party headers are SYSTEM includes).
# Installed, the headers live in <prefix>/include/tessera/<folder>/ (nothing of Tessera's
# lands in <prefix>/include itself): the package's users reach them as "<folder>/x.h",
# as Tessera's own headers include each other, or as <tessera/<folder>/x.h>.
function(tessera_target_defaults target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${TESSERA_WARNINGS}>)
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<INSTALL_INTERFACE:include/tessera>
    $<INSTALL_INTERFACE:include>)
endfunction()
