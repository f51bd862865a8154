// The copy-engine path measured by benchmarks/gpu_overlap.py: one cudaMemcpyBatchAsync per move (a copy per
// contiguous block run), or one cudaMemcpyAsync per run. Built at run time: nvcc -shared -Xcompiler -fPIC.
#include <cuda_runtime.h>
#include <stddef.h>

extern "C" int ce_batch(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                        int prefer_overlap, void* stream) {
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = prefer_overlap ? cudaMemcpyFlagPreferOverlapWithCompute : cudaMemcpyFlagDefault;
  size_t idx = 0;
  return (int)cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &idx, 1, (cudaStream_t)stream);
}

extern "C" int ce_loop(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                       void* stream) {
  for (size_t i = 0; i < count; i++) {
    cudaError_t err = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, (cudaStream_t)stream);
    if (err != cudaSuccess) return (int)err;
  }
  return 0;
}
