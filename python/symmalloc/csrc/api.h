// symmalloc's C++ allocator for PyTorch: libsymmalloc's C ABI as the allocator calls it.
// Included by torch_allocator.cpp only.
//
// Owns: the table of libsymmalloc's functions (`api`, filled once by load_api with dlopen from
// the path the Python package gives, each entry typed from include/symmalloc.h's declaration),
// short names for the header's structs, and the helpers over them every part of the allocator
// uses: check() and last_error() (a failed call as a c10::Error), the statistics as PyTorch's
// types, and the blocks of the heaps
// (list_blocks, for_each_heap, a segment found by address, a live block's request by address).
//
// Invariants:
// - The C ABI comes from include/symmalloc.h alone: no struct or prototype is declared here.
// - `api` is filled before the allocator object exists (torch_allocator.cpp's make) and never
//   changes after; nothing here keeps state of its own.
// - list_blocks and the lookups over it only read the heaps: they never place or free memory,
//   and never make a heap (a device the process did not allocate on lists no blocks).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include "torch_compat.h"
#include "symmalloc.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::Stat;  // TraceEntry and the other moved names: torch_compat.h
namespace CCA = c10::cuda::CUDACachingAllocator;
using MempoolId = c10::MempoolId_t;

// ---- libsymmalloc's C ABI: include/symmalloc.h itself (the wheel carries it in
// symmalloc/include/; _torch_ext.build() puts that folder, or a checkout's include/, on the
// include path) ----
constexpr int kSuccess = SYMM_SUCCESS;
constexpr int kOutOfMemory = SYMM_ERR_OUT_OF_MEMORY;

// The allocator's short names for the header's structs (aliases, not copies).
using SymmStat = symm_stat_t;
using SymmDeviceStats = symm_device_stats_t;
using SymmBlock = symm_block_info_t;
using SymmSegmentEvent = symm_segment_event_t;
static_assert(sizeof(SymmDeviceStats) == SYMM_DEVICE_STATS_V1_SIZE, "symm_device_stats_t v1");
constexpr uint32_t kBlockLive = SYMM_BLOCK_LIVE;
constexpr uint32_t kSegmentLost = SYMM_SEGMENT_LOST, kSegmentMade = SYMM_SEGMENT_MADE,
                   kSegmentMapped = SYMM_SEGMENT_MAPPED, kSegmentFreed = SYMM_SEGMENT_FREED;

using FilterFn = symm_pool_filter_fn;
using DropFn = symm_pool_filter_drop_fn;

// The functions the allocator calls, each typed from its declaration in the header (dlsym fills
// them: the library is loaded from the path the Python package gives, never linked).
#define SYMM_FN(name) decltype(&symm_##name)
struct Api {
  SYMM_FN(malloc_checked) malloc_checked;
  SYMM_FN(free_block) free_block;
  SYMM_FN(record_stream) record_stream;
  SYMM_FN(empty_cache) empty_cache;
  SYMM_FN(device_stats) device_stats;
  SYMM_FN(reset_peak_stats) reset_peak;
  SYMM_FN(reset_accumulated_stats) reset_accumulated;
  SYMM_FN(set_memory_limit) set_memory_limit;
  SYMM_FN(cache_info) cache_info;
  SYMM_FN(heap_blocks) heap_blocks;
  SYMM_FN(pool_hold) pool_hold;
  SYMM_FN(pool_uses) pool_uses;
  SYMM_FN(pool_restore) pool_restore;
  SYMM_FN(begin_pool_filtered) begin_pool_filtered;
  SYMM_FN(end_pool) end_pool;
  SYMM_FN(release_pool) release_pool;
  SYMM_FN(segment_log) segment_log;
  SYMM_FN(segment_events) segment_events;
  SYMM_FN(block_request) block_request;
  SYMM_FN(grant_peer_access) grant_peer_access;
  SYMM_FN(last_error) last_error;
};
#undef SYMM_FN

Api api;

inline std::string last_error() {
  const char* e = api.last_error();
  return e ? std::string(e) : std::string();
}

inline void check(int status, const char* what) {
  TORCH_CHECK(status == kSuccess, "symmalloc: ", what, " failed: ", last_error());
}

inline Stat to_stat(const SymmStat& s) {
  Stat out;
  out.current = s.current;
  out.peak = s.peak;
  out.allocated = s.allocated;
  out.freed = s.freed;
  return out;
}

inline void copy_array(c10::CachingAllocator::StatArray& dst, const SymmStat (&src)[3]) {
  for (size_t i = 0; i < 3; ++i) dst[i] = to_stat(src[i]);
}

// symm_device_stats_t as PyTorch's DeviceStats, field by field.
inline DeviceStats to_device_stats(const SymmDeviceStats& s) {
  DeviceStats out;
  copy_array(out.allocation, s.allocation);
  copy_array(out.segment, s.segment);
  copy_array(out.active, s.active);
  copy_array(out.inactive_split, s.inactive_split);
  copy_array(out.allocated_bytes, s.allocated_bytes);
  copy_array(out.reserved_bytes, s.reserved_bytes);
  copy_array(out.active_bytes, s.active_bytes);
  copy_array(out.inactive_split_bytes, s.inactive_split_bytes);
  copy_array(out.requested_bytes, s.requested_bytes);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  out.oversize_allocations = to_stat(s.oversize_allocations);
  out.oversize_segments = to_stat(s.oversize_segments);
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  out.max_split_size = s.max_split_size;
  return out;
}

inline std::vector<SymmBlock> list_blocks(int device, const MempoolId* pool) {
  for (;;) {
    size_t n = 0;
    check(api.heap_blocks(device, pool ? 0 : 1, pool ? pool->first : 0, pool ? pool->second : 0,
                          nullptr, 0, &n),
          "symm_heap_blocks");
    std::vector<SymmBlock> v(n + 16);
    size_t m = 0;
    check(api.heap_blocks(device, pool ? 0 : 1, pool ? pool->first : 0, pool ? pool->second : 0,
                          v.data(), v.size(), &m),
          "symm_heap_blocks");
    if (m <= v.size()) {
      v.resize(m);
      return v;
    }
  }
}

// fn(device, blocks) with the blocks (list_blocks: of `pool`, or of every pool with nullptr) of
// each device 0..max(device_count, 1) - 1 in turn, skipping a device whose heap cannot be read;
// stops at the first fn that returns true.
template <typename Fn>
void for_each_heap(int device_count, const MempoolId* pool, Fn&& fn) {
  for (int d = 0; d < std::max(device_count, 1); ++d) {
    std::vector<SymmBlock> blocks;
    try {
      blocks = list_blocks(d, pool);
    } catch (const c10::Error&) {
      continue;  // a device whose heap cannot be read (none made there, no such device)
    }
    if (fn(d, blocks)) return;
  }
}

// The device whose heap holds a segment with `ptr` in it (0 when none does).
inline int device_of(int device_count, void* ptr) {
  int found = 0;
  for_each_heap(device_count, nullptr, [&](int d, const std::vector<SymmBlock>& blocks) {
    for (const auto& b : blocks)
      if ((uint64_t)ptr >= b.segment_address &&
          (uint64_t)ptr < b.segment_address + b.segment_size) {
        found = d;
        return true;
      }
    return false;
  });
  return found;
}

// The device and request of the live block at `p`, looked up by address (no walk): false, with
// nothing written, when `p` is not a live block of the heap.
inline bool block_request(void* p, int* device, size_t* size, cudaStream_t* stream = nullptr) {
  int d = 0;
  uint64_t requested = 0;
  cudaStream_t s = nullptr;
  if (api.block_request(p, &d, &requested, &s) != kSuccess) return false;
  *device = d;
  *size = (size_t)requested;
  if (stream) *stream = s;
  return true;
}

// Fills `api` from the library at `path`: "" on success, else why not.
inline std::string load_api(const char* path) {
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) return std::string("cannot load ") + path + ": " + dlerror();
  std::string missing;
  auto sym = [&](const char* name) -> void* {
    void* p = dlsym(h, name);
    if (!p) missing += std::string(missing.empty() ? "" : ", ") + name;
    return p;
  };
#define SYMM_LOAD(field, name) api.field = reinterpret_cast<decltype(api.field)>(sym(name))
  SYMM_LOAD(malloc_checked, "symm_malloc_checked");
  SYMM_LOAD(free_block, "symm_free_block");
  SYMM_LOAD(record_stream, "symm_record_stream");
  SYMM_LOAD(empty_cache, "symm_empty_cache");
  SYMM_LOAD(device_stats, "symm_device_stats");
  SYMM_LOAD(reset_peak, "symm_reset_peak_stats");
  SYMM_LOAD(reset_accumulated, "symm_reset_accumulated_stats");
  SYMM_LOAD(set_memory_limit, "symm_set_memory_limit");
  SYMM_LOAD(cache_info, "symm_cache_info");
  SYMM_LOAD(heap_blocks, "symm_heap_blocks");
  SYMM_LOAD(pool_hold, "symm_pool_hold");
  SYMM_LOAD(pool_uses, "symm_pool_uses");
  SYMM_LOAD(pool_restore, "symm_pool_restore");
  SYMM_LOAD(begin_pool_filtered, "symm_begin_pool_filtered");
  SYMM_LOAD(end_pool, "symm_end_pool");
  SYMM_LOAD(release_pool, "symm_release_pool");
  SYMM_LOAD(segment_log, "symm_segment_log");
  SYMM_LOAD(segment_events, "symm_segment_events");
  SYMM_LOAD(block_request, "symm_block_request");
  SYMM_LOAD(grant_peer_access, "symm_grant_peer_access");
  SYMM_LOAD(last_error, "symm_last_error");
#undef SYMM_LOAD
  if (!missing.empty()) return std::string(path) + " lacks " + missing + " (an older library)";
  return "";
}

}  // namespace
}  // namespace symm_torch
