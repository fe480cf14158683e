// How many threads Tessera's own CPU loops run on. They use at::parallel_for, a header
// template that spreads a loop over LibTorch's OpenMP threads only in code compiled with
// OpenMP (cmake: tessera_parallel_loops); compiled without, every loop runs on the calling
// thread whatever at::get_num_threads() says — which is what the fused AdamW, the norms
// and the EMA blend did until that was found on a 16-core host (4 s of optimizer step).
#pragma once

namespace tessera::kernels {

// The threads an at::parallel_for of this library actually ran on, counted by running one
// (up to at::get_num_threads(); 1 inside a parallel region).
int parallelLoopThreads();

}  // namespace tessera::kernels
