// symmalloc's C++ allocator for PyTorch: out of memory as PyTorch's allocator reports it.
// Included by torch_allocator.cpp only.
//
// Owns: the c10::OutOfMemoryError a failed allocation raises (PyTorch's words, with symmalloc's
// reason at the end), the out-of-memory observers' call and the oom trace entry on the way
// (history.h keeps both), bytes_str, the sizes in those messages, allocation_size, the
// segment size PyTorch's allocator would have asked the driver for, and cache_info, PyTorch's
// cacheInfo (the free memory and cached blocks a cuDNN workspace may take).
//
// Invariants:
// - out_of_memory always throws c10::OutOfMemoryError and changes nothing in the heap; the
//   frames are gathered and the observers called outside every allocator lock.
// - The observers get PyTorch's arguments: (device, the allocation size PyTorch's allocator
//   would have made for the request, the memory cap set by set_per_process_memory_fraction or
//   else the device's total, the device's free memory).
// - A request past any device's size says "more than 1EB", as PyTorch's allocator does.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
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

// The segment PyTorch's allocator asks the driver for to serve `n` bytes (its round_size, then
// get_allocation_size with default settings: small requests share 2 MiB, those under 10 MiB
// take 20 MiB, larger ones their size rounded to 2 MiB). The heap's own segments are sized the
// same (heap/size_class.rs) at the 2 MiB granularity of current GPUs.
inline size_t allocation_size(size_t n) {
  constexpr size_t kMinBlock = 512, kSmallSize = 1 << 20, kSmallBuffer = 2 << 20,
                   kMinLargeAlloc = 10 << 20, kLargeBuffer = 20 << 20, kRoundLarge = 2 << 20;
  if (n >= (size_t)1 << 60) return n;  // past any device (the message says so)
  size_t size = n < kMinBlock ? kMinBlock : kMinBlock * ((n + kMinBlock - 1) / kMinBlock);
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
}

// PyTorch's cacheInfo (which cuDNN's benchmark mode reads to size its workspace), computed as
// PyTorch's allocator computes it: from *largest, or when that is 0 from the free memory of the
// current device (cudaMemGetInfo, as PyTorch: no device is switched to), the largest free
// block cached in any pool of `device`, private pools (graph captures, MemPools) included. The
// default pool's large blocks this thread's cache keeps are merged first, as a large request
// would (symm_cache_info); blocks thread caches keep count as free (a large request or an out
// of memory takes them back). Without a CUDA device (the host backend) the free memory is 0.
inline void cache_info(int device, size_t* largest) {
  if (*largest == 0) {
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) == cudaSuccess)
      *largest = free_b;
    else
      (void)cudaGetLastError();
  }
  uint64_t most = 0;
  check(api.cache_info(device, &most), "cacheInfo");
  *largest = std::max<size_t>(*largest, (size_t)most);
  for (const auto& b : list_blocks(device, nullptr))
    if (b.state != kBlockLive) *largest = std::max<size_t>(*largest, b.size);
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
  auto ctx = history.active() ? history.gather(CCA::RecordContext::STATE) : nullptr;
  uint64_t allowed = 0;
  std::vector<CCA::OutOfMemoryObserver> observers =
      history.note_oom(device, free_b, n, stream, std::move(ctx), &allowed);
  for (const auto& obs : observers)
    obs(device, allocation_size(n), allowed > 0 ? allowed : total, free_b);
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
