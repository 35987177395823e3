// symmalloc's C++ allocator for PyTorch: out of memory as PyTorch's allocator reports it.
// Included by torch_allocator.cpp only.
//
// Owns: the c10::OutOfMemoryError a failed allocation raises (PyTorch's words, with symmalloc's
// reason at the end), the out-of-memory observers' call and the oom trace entry on the way
// (history.h keeps both), and bytes_str, the sizes in those messages.
//
// Invariants:
// - out_of_memory always throws c10::OutOfMemoryError and changes nothing in the heap; the
//   observers are called outside the history lock.
// - A request past any device's size says "more than 1EB", as PyTorch's allocator does.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "api.h"
#include "history.h"

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

inline std::string bytes_str(uint64_t b) {
  std::ostringstream o;
  if (b >= (1ull << 30)) {
    o.precision(2);
    o << std::fixed << (double)b / (1ull << 30) << " GiB";
  } else {
    o.precision(2);
    o << std::fixed << (double)b / (1ull << 20) << " MiB";
  }
  return o.str();
}

// ---- the out-of-memory path ----
[[noreturn]] inline void out_of_memory(History& history, c10::DeviceIndex device, size_t n,
                                       cudaStream_t stream, const std::string& why) {
  size_t free_b = 0, total = 0;
  if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
    (void)cudaGetLastError();  // no device (host backend) or a broken context: say unknown
    free_b = total = 0;
  }
  SymmDeviceStats s{};
  (void)api.device_stats(device, &s, sizeof s);
  uint64_t allocated = s.allocated_bytes[0].current;
  uint64_t reserved = s.reserved_bytes[0].current;
  std::vector<CCA::OutOfMemoryObserver> observers = history.note_oom(device, free_b, n, stream);
  for (const auto& obs : observers) obs(device, allocated, total, free_b);
  std::ostringstream msg;
  if (n >= (size_t)1 << 60) {  // PyTorch's words for a request larger than any device
    msg << "CUDA out of memory. Tried to allocate more than 1EB memory. (symmalloc: " << why
        << ")";
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg.str());
  }
  msg << "CUDA out of memory. Tried to allocate " << bytes_str(n) << ". GPU " << int(device);
  if (total > 0) {
    msg << " has a total capacity of " << bytes_str(total) << " of which " << bytes_str(free_b)
        << " is free.";
  } else {
    msg << ".";
  }
  msg << " Of the allocated memory " << bytes_str(allocated)
      << " is allocated by symmalloc, and " << bytes_str(reserved > allocated ? reserved - allocated : 0)
      << " is reserved by symmalloc but unallocated. (symmalloc: " << why << ")";
  TORCH_CHECK_WITH(OutOfMemoryError, false, msg.str());
}

}  // namespace
}  // namespace symm_torch
