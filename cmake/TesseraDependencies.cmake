# Finds every third-party dependency once, for all targets.
#
# LibTorch comes either from Debian's libtorch-dev 1.13 (CPU; the default) or from
# CMAKE_PREFIX_PATH, e.g. the LibTorch inside a PyTorch 2.x CUDA wheel:
#   cmake -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
find_package(Torch REQUIRED)
message(STATUS "Tessera: LibTorch ${Torch_VERSION} from ${TORCH_INSTALL_PREFIX}")

# TORCH_LIBRARIES carries c10_cuda / torch_cuda only in a CUDA build of LibTorch.
set(TESSERA_TORCH_HAS_CUDA OFF)
if(TARGET torch_cuda OR TARGET c10_cuda OR "${TORCH_LIBRARIES}" MATCHES "c10_cuda")
  set(TESSERA_TORCH_HAS_CUDA ON)
endif()
if(TESSERA_WITH_CUDA STREQUAL "AUTO")
  set(TESSERA_CUDA_ENABLED ${TESSERA_TORCH_HAS_CUDA})
else()
  set(TESSERA_CUDA_ENABLED ${TESSERA_WITH_CUDA})
endif()
if(TESSERA_CUDA_ENABLED)
  find_package(CUDAToolkit REQUIRED)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} $ENV{NCCL_HOME}/include /usr/local/cuda/include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} $ENV{NCCL_HOME}/lib /usr/local/cuda/lib64)
  if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
    message(FATAL_ERROR "TESSERA_WITH_CUDA is on but NCCL was not found (set NCCL_HOME)")
  endif()
  message(STATUS "Tessera: CUDA + NCCL backend ON (${NCCL_LIBRARY}); LibTorch has CUDA: ${TESSERA_TORCH_HAS_CUDA}")
else()
  message(STATUS "Tessera: CUDA + NCCL backend OFF")
endif()

# c10d's ProcessGroupGloo headers include gloo's; Debian ships them in libgloo-dev,
# the PyTorch wheel ships them inside its include directory.
find_path(GLOO_INCLUDE_DIR gloo/config.h HINTS ${TORCH_INCLUDE_DIRS})
if(NOT GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "gloo headers (gloo/config.h) not found: install libgloo-dev")
endif()

find_package(yaml-cpp REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 REQUIRED)
find_package(nlohmann_json REQUIRED)
find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_library(XXHASH_LIBRARY xxhash REQUIRED)
find_package(Threads REQUIRED)
# OpenMP: LibTorch's at::parallel_for is a header template that spreads a loop over
# LibTorch's OpenMP threads only in code compiled with -fopenmp; elsewhere it runs the
# whole loop on the calling thread. Tessera's own CPU loops (AdamW, gradient norms, the
# EMA blend, GELU, per-head products, initialisation) are built with it
# (tessera_parallel_loops). A fuzzing build (clang, whose libomp-dev the setup does not
# install) does without: its loops run on one thread.
if(TESSERA_BUILD_FUZZ)
  find_package(OpenMP COMPONENTS CXX)
else()
  find_package(OpenMP REQUIRED COMPONENTS CXX)
endif()
# A PyTorch wheel's LibTorch carries a libgomp of its own (lib/libgomp-<hash>.so.1):
# Tessera's loops then use that one, so that they share LibTorch's thread pool and
# at::set_num_threads, instead of a second pool from the system's libgomp.
file(GLOB TESSERA_TORCH_GOMP "${TORCH_INSTALL_PREFIX}/lib/libgomp*.so*")
if(TESSERA_TORCH_GOMP)
  list(GET TESSERA_TORCH_GOMP 0 TESSERA_TORCH_GOMP)
  message(STATUS "Tessera: OpenMP loops on LibTorch's own ${TESSERA_TORCH_GOMP}")
endif()
# oneDNN (libdnnl-dev; LibTorch itself links libdnnl): fp32 CPU products at the core's speed
# (kernels/). Optional: without it they are LibTorch's, through whatever BLAS it loads.
find_path(TESSERA_ONEDNN_INCLUDE_DIR oneapi/dnnl/dnnl.h)
find_library(TESSERA_ONEDNN_LIBRARY dnnl)
if(TESSERA_ONEDNN_INCLUDE_DIR AND TESSERA_ONEDNN_LIBRARY)
  message(STATUS "Tessera: oneDNN ${TESSERA_ONEDNN_LIBRARY} for fp32 CPU matrix products")
else()
  set(TESSERA_ONEDNN_LIBRARY "")
  message(STATUS "Tessera: oneDNN not found (libdnnl-dev): fp32 CPU products use LibTorch's BLAS")
endif()
if(TESSERA_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(TESSERA_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()
