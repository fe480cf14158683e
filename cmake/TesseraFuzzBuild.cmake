# The libFuzzer targets (fuzz/) need clang; the main build may use any compiler. When
# clang++ is there (scripts/setup.sh installs it), the main build configures and builds
# fuzz/ as a nested build in build/fuzz (step `tessera_fuzz`), and ctest runs each target
# for a fixed number of inputs on its committed seeds (tests/CMakeLists.txt).
find_program(TESSERA_CLANGXX NAMES clang++ clang++-14)
option(TESSERA_FUZZ_SMOKE "Build the fuzz targets with clang (build/fuzz) and run each briefly in ctest" ON)
set(TESSERA_FUZZ_ENABLED OFF)
set(TESSERA_FUZZ_BINARY_DIR ${CMAKE_BINARY_DIR}/fuzz)
if(TESSERA_FUZZ_SMOKE AND TESSERA_CLANGXX)
  include(ExternalProject)
  ExternalProject_Add(tessera_fuzz
    SOURCE_DIR ${PROJECT_SOURCE_DIR}
    BINARY_DIR ${TESSERA_FUZZ_BINARY_DIR}
    CMAKE_GENERATOR ${CMAKE_GENERATOR}
    CMAKE_ARGS -DCMAKE_CXX_COMPILER=${TESSERA_CLANGXX} -DTESSERA_BUILD_FUZZ=ON -DTESSERA_BUILD_TESTS=OFF
               -DTESSERA_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
               # -O1 and line tables (what a sanitizer's report needs), as the sanitizers' docs
               # suggest: a fraction of -O2 -g's compile time
               "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG"
               -DCMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER}
    INSTALL_COMMAND ""
    BUILD_ALWAYS ON  # the nested ninja decides what changed
    USES_TERMINAL_BUILD ON)
  set(TESSERA_FUZZ_ENABLED ON)
elseif(TESSERA_FUZZ_SMOKE)
  message(WARNING "clang++ not found: the fuzz targets are not built or run (scripts/setup.sh installs clang)")
endif()
