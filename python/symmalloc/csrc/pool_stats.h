// symmalloc's C++ allocator for PyTorch: the bytes each private pool holds (PyTorch's
// DeviceStats::reserved_bytes_by_private_pools, torch 2.13+, memory_stats' nested dict keyed by
// MempoolId). Included by torch_allocator.cpp only.
//
// Owns: the private pools the allocator was handed (graph captures' and MemPools' ids, from
// createOrIncrefPool and beginAllocateToPool) per device, and each one's statistic as the
// reads have seen it.
//
// Invariants:
// - `current` is exact at each read: the bytes of the pool's segments, per class (a segment's
//   class is its blocks'), from the heap's listing of that pool's blocks (symm_heap_blocks; it
//   walks the segments and the pool's blocks only). The heap keeps no per-pool counters, so
//   `peak` is the highest `current` seen, and `allocated` / `freed` add up the rises and falls
//   seen. Seen: at each read, and (torch 2.13+, where PyTorch reads them) at the end of each
//   route to the pool and around its release (`sample`). A live pool only grows while a route
//   to it is open (a live pool keeps its segments; they go at its release), so these are
//   exact unless a read falls inside a route.
// - A pool stays listed after it is released, with `current` 0 (PyTorch's: "current drops to 0
//   when a pool is deleted, while peak/allocated/freed are preserved until reset"); the resets
//   drop a released pool whose statistic is then all zero.
// - A MemPool with an allocator of its own (foreign_pools.h) is not listed: its blocks are that
//   allocator's memory, not the heap's.
// - Nothing here is on the allocation path: the noting calls are the pool's begin and creation,
//   the rest are statistics reads; one mutex of its own, a leaf (the heap's listing is taken
//   under it, and the heap calls nothing back).
#pragma once

#include <c10/core/CachingDeviceAllocator.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "api.h"

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

class PoolStats {
 public:
  using StatArray = c10::CachingAllocator::StatArray;

  // A private pool of `device` the allocator was handed (not the default pool).
  void note(int device, MempoolId id) {
    if (id.first == 0 && id.second == 0) return;
    std::lock_guard<std::mutex> g(mu_);
    seen_[device].emplace(id, StatArray{});
  }

  // Each noted pool of `device` with its reserved bytes (aggregate, small, large), updated from
  // the heap now; pools in id order.
  std::vector<std::pair<MempoolId, StatArray>> read(int device) {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::pair<MempoolId, StatArray>> out;
    auto d = seen_.find(device);
    if (d == seen_.end()) return out;
    for (auto& [id, st] : d->second) {
      update(device, id, st);
      out.emplace_back(id, st);
    }
    return out;
  }

  // The pool's statistic brought up to date now (the end of a route to it, its release).
  void sample(int device, MempoolId id) {
    std::lock_guard<std::mutex> g(mu_);
    auto d = seen_.find(device);
    if (d == seen_.end()) return;
    auto p = d->second.find(id);
    if (p != d->second.end()) update(device, id, p->second);
  }

  // resetPeakStats / resetAccumulatedStats of `device`, for its pools.
  void reset_peak(int device) {
    reset(device, [](c10::CachingAllocator::Stat& s) { s.peak = s.current; });
  }
  void reset_accumulated(int device) {
    reset(device, [](c10::CachingAllocator::Stat& s) { s.allocated = s.freed = 0; });
  }

 private:
  // Under mu_.
  static void update(int device, MempoolId id, StatArray& st) {
    int64_t now[3] = {0, 0, 0};
    std::vector<SymmBlock> blocks;
    try {
      blocks = list_blocks(device, &id);
    } catch (const c10::Error&) {
      // No heap on this device (nothing allocated there): the pool holds nothing.
    }
    uint64_t last_segment = UINT64_MAX;
    for (const auto& b : blocks) {
      if (b.segment_address == last_segment) continue;
      last_segment = b.segment_address;
      now[0] += (int64_t)b.segment_size;
      now[b.is_large ? 2 : 1] += (int64_t)b.segment_size;
    }
    for (int i = 0; i < 3; ++i) {
      auto& s = st[i];
      if (now[i] > s.current) s.allocated += now[i] - s.current;
      if (now[i] < s.current) s.freed += s.current - now[i];
      s.current = now[i];
      s.peak = std::max(s.peak, s.current);
    }
  }

  template <typename Fn>
  void reset(int device, Fn fn) {
    read(device);  // `current` as of now, so that peak = current holds after
    std::lock_guard<std::mutex> g(mu_);
    auto d = seen_.find(device);
    if (d == seen_.end()) return;
    for (auto it = d->second.begin(); it != d->second.end();) {
      bool zero = true;
      for (auto& s : it->second) {
        fn(s);
        zero = zero && s.current == 0 && s.peak == 0 && s.allocated == 0 && s.freed == 0;
      }
      // A released pool whose statistic is all zero goes; a pool still held may be used again.
      it = zero && !held(device, it->first) ? d->second.erase(it) : std::next(it);
    }
  }

  // Whether the heap still counts uses of the pool (a MemPool alive, a graph not deleted).
  static bool held(int device, MempoolId id) {
    uint64_t uses = 0;
    return api.pool_uses(device, id.first, id.second, &uses) == kSuccess && uses > 0;
  }

  std::mutex mu_;
  std::map<int, std::map<MempoolId, StatArray>> seen_;
};

}  // namespace
}  // namespace symm_torch
