// symmalloc's C++ allocator for PyTorch: memory while caching is off
// (torch.cuda.caching_allocator_enable(False)). Included by torch_allocator.cpp only.
//
// Owns: the blocks allocated while caching was off, straight from cudaMalloc, as PyTorch's own
// allocator does then: not in the heap, not symmetric, not in the statistics, given back with
// cudaFree at their free (whenever that comes, caching on again or not).
//
// Invariants:
// - A pointer is in `live_` from its cudaMalloc to its cudaFree, and nowhere in the heap.
// - With none live, the free path pays one relaxed atomic load.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>
#include <unordered_set>

namespace symm_torch {

class Uncached {
 public:
  // cudaMalloc on `device`. *status: cudaSuccess with the pointer; cudaErrorMemoryAllocation
  // when the device is full; another error (no CUDA device: the host backend) when the caller
  // should go on through the heap.
  void* malloc(int device, size_t n, cudaError_t* status) {
    int prev = -1;
    void* p = nullptr;
    *status = cudaGetDevice(&prev);
    if (*status == cudaSuccess && prev != device) *status = cudaSetDevice(device);
    if (*status == cudaSuccess) *status = cudaMalloc(&p, n);
    if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
    if (*status != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    std::lock_guard<std::mutex> g(mu_);
    live_.insert(p);
    count_.store(live_.size(), std::memory_order_relaxed);
    return p;
  }

  // True when `p` was ours (then given back with cudaFree).
  bool free(void* p) {
    if (count_.load(std::memory_order_relaxed) == 0) return false;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (live_.erase(p) == 0) return false;
      count_.store(live_.size(), std::memory_order_relaxed);
    }
    if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
    return true;
  }

 private:
  std::mutex mu_;
  std::unordered_set<void*> live_;
  std::atomic<size_t> count_{0};
};

}  // namespace symm_torch
