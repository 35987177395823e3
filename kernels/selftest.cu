// Self-test kernel: y[i] = a * x[i] + y[i] over fp32. Used by the demo and the C harness to
// prove the embedded fatbin loads and launches on a device.
#include "common.cuh"

struct SaxpyArgs {
  uint64_t x;
  uint64_t y;
  uint64_t n;
  float a;
  float reserved;
};

extern "C" __global__ void symm_selftest_saxpy(SaxpyArgs p) {
  const uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) ((float*)p.y)[i] = p.a * ((const float*)p.x)[i] + ((float*)p.y)[i];
}
