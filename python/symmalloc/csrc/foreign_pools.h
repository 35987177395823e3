// symmalloc's C++ allocator for PyTorch: MemPools that name an allocator of their own.
// Included by torch_allocator.cpp only.
//
// Owns: the pools whose MemPool named its own allocator (MemPool(allocator=...), NCCL's for
// buffer registration, say: createOrIncrefPool) with their use counts, the routes open to them
// (beginAllocateToPool .. endAllocateToPool), and each live block they gave (its allocator,
// device, size, stream and pool), which snapshots list as segments of their pool (NCCL's
// register_mem_pool registers what the pool's snapshot lists, and its allocator hook the
// segment entries of later ones, which the history records here). Their blocks come from that
// allocator, never from symmalloc's heap, as PyTorch's allocator does it.
//
// Invariants:
// - Everything is under `foreign_mu_` but the two counters, `foreign_routes_` (routes open) and
//   `foreign_live_` (blocks live), so that with none the allocation and free paths pay one
//   relaxed atomic load each.
// - The newest open route of a device whose filter takes the stream gives the block; a block is
//   freed by the allocator that gave it (held here until its free), whatever the pools did since.
// - A foreign route counts in the allocator's open pool routes (`routes_open`, PyTorch's
//   "captures underway") like a route into the heap, under the same lock as the route itself.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "api.h"
#include "history.h"
#include "oom.h"

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

class ForeignPools {
 public:
  int routes() const { return foreign_routes_.load(std::memory_order_relaxed); }
  int live() const { return foreign_live_.load(std::memory_order_relaxed); }

  // createOrIncrefPool of a MemPool with its own allocator.
  void adopt(MempoolId id, std::shared_ptr<CCA::CUDAAllocator> allocator) {
    std::lock_guard<std::mutex> g(foreign_mu_);
    auto& fp = foreign_pools_[id];
    fp.allocator = std::move(allocator);
    fp.uses++;
  }

  // beginAllocateToPool: true, with the route open (and counted in `routes_open`), when `id` is
  // a pool of its own allocator (then `filter` is taken); false, nothing done, otherwise.
  bool begin(c10::DeviceIndex device, MempoolId id, std::function<bool(cudaStream_t)>& filter,
             std::atomic<int>& routes_open) {
    std::lock_guard<std::mutex> g(foreign_mu_);
    auto it = foreign_pools_.find(id);
    if (it != foreign_pools_.end()) {
      it->second.uses++;
      routes_.push_back({device, id, std::move(filter), it->second.allocator});
      foreign_routes_.fetch_add(1);
      routes_open.fetch_add(1);
      return true;
    }
    return false;
  }

  // endAllocateToPool: true, with the newest route of (device, id) closed, when there is one.
  bool end(c10::DeviceIndex device, MempoolId id, std::atomic<int>& routes_open) {
    std::lock_guard<std::mutex> g(foreign_mu_);
    for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {
      if (it->device == device && it->pool == id) {
        routes_.erase(std::next(it).base());
        foreign_routes_.fetch_sub(1);
        routes_open.fetch_sub(1);
        return true;
      }
    }
    return false;
  }

  // releasePool: true, with a use dropped (the pool forgotten at none), when `id` is one.
  bool release(MempoolId id) {
    std::lock_guard<std::mutex> g(foreign_mu_);
    auto it = foreign_pools_.find(id);
    if (it != foreign_pools_.end()) {
      if (--it->second.uses <= 0) foreign_pools_.erase(it);
      return true;
    }
    return false;
  }

  // getPoolUseCount: true, with *out set to its uses, when `id` is one.
  bool uses(MempoolId id, int* out) {
    std::lock_guard<std::mutex> g(foreign_mu_);
    auto it = foreign_pools_.find(id);
    if (it != foreign_pools_.end()) {
      *out = it->second.uses;
      return true;
    }
    return false;
  }

  // The allocation, when an open route of `device` takes `stream` (nullptr when none does),
  // recorded in `hist` while it is active (frames gathered with no lock held).
  void* malloc(c10::DeviceIndex device, size_t n, cudaStream_t stream, History& hist) {
    std::shared_ptr<CCA::CUDAAllocator> alloc;
    MempoolId pool{0, 0};
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      for (auto it = routes_.rbegin(); it != routes_.rend(); ++it)
        if (it->device == device && it->filter(stream)) {
          alloc = it->allocator;
          pool = it->pool;
          break;
        }
    }
    if (!alloc) return nullptr;
    auto ctx = hist.active() ? hist.gather(CCA::RecordContext::STATE) : nullptr;
    c10::cuda::CUDAGuard guard(device);
    void* p = alloc->raw_alloc_with_stream(n, stream);
    TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr, "CUDA out of memory. Tried to allocate ",
                     bytes_str(n), " from the MemPool's own allocator (", alloc->name(), ")");
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      foreign_ptrs_[p] = ForeignBlock{std::move(alloc), device, n, stream, pool, next_seq_++};
      foreign_live_.fetch_add(1);
    }
    if (hist.active()) hist.note_foreign(true, device, p, n, stream, pool, std::move(ctx));
    return p;
  }

  // True when `p` came from a pool of its own allocator (then given back to it, recorded in
  // `hist` first while it is active).
  bool free(void* p, History& hist) {
    ForeignBlock b;
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      auto it = foreign_ptrs_.find(p);
      if (it == foreign_ptrs_.end()) return false;
      b = std::move(it->second);
      foreign_ptrs_.erase(it);
      foreign_live_.fetch_sub(1);
    }
    if (hist.active())
      hist.note_foreign(false, b.device, p, b.size, b.stream, b.pool,
                        hist.gather(CCA::RecordContext::ALL));
    b.allocator->raw_delete(p);
    return true;
  }

  // The live blocks of pools with their own allocator, into a snapshot's segments (those of
  // `pool` alone unless it is {0, 0}, as snapshot(mempool_id) asks): each a segment of its own,
  // one live block filling it, owned by its pool, as PyTorch lists a MemPool's segments, in
  // allocation order with that order as registration_counter (NCCL's symmetric registration
  // walks a pool's segments in that order on every rank).
  void add_segments(CCA::SnapshotInfo* out, MempoolId pool) {
    if (live() == 0) return;
    bool one_pool = pool.first != 0 || pool.second != 0;
    std::lock_guard<std::mutex> g(foreign_mu_);
    std::vector<std::pair<void*, const ForeignBlock*>> blocks;
    for (const auto& [p, b] : foreign_ptrs_)
      if (!one_pool || b.pool == pool) blocks.push_back({p, &b});
    std::sort(blocks.begin(), blocks.end(),
              [](const auto& x, const auto& y) { return x.second->seq < y.second->seq; });
    for (const auto& [p, bp] : blocks) {
      const ForeignBlock& b = *bp;
      CCA::SegmentInfo seg;
      seg.device = b.device;
      seg.address = (size_t)(uintptr_t)p;
      seg.total_size = seg.allocated_size = seg.active_size = seg.requested_size = b.size;
      seg.stream = (TraceStream)b.stream;
      seg.is_large = b.size > ((size_t)1 << 20);
      seg.is_expandable = false;
      seg.owner_private_pool_id = b.pool;
#if SYMM_TORCH_HAS_REGISTRATION_COUNTER
      seg.registration_counter = (int32_t)b.seq;
#endif
      BlockInfo bi;
      bi.size = bi.requested_size = b.size;
      bi.allocated = bi.active = true;
      seg.blocks.push_back(std::move(bi));
      out->segments.push_back(std::move(seg));
    }
  }

 private:
  // A route to a pool whose MemPool named its own allocator (createOrIncrefPool).
  struct ForeignRoute {
    c10::DeviceIndex device;
    MempoolId pool;
    std::function<bool(cudaStream_t)> filter;
    std::shared_ptr<CCA::CUDAAllocator> allocator;
  };
  struct ForeignPool {
    std::shared_ptr<CCA::CUDAAllocator> allocator;
    int uses = 0;
  };
  // A live block from a pool's own allocator.
  struct ForeignBlock {
    std::shared_ptr<CCA::CUDAAllocator> allocator;
    c10::DeviceIndex device = 0;
    size_t size = 0;
    cudaStream_t stream = nullptr;
    MempoolId pool{0, 0};
    uint64_t seq = 0;  // allocation order
  };
  struct MempoolHash {
    size_t operator()(const MempoolId& id) const {
      return std::hash<uint64_t>()(id.first) * 31 + std::hash<uint64_t>()(id.second);
    }
  };

  std::mutex foreign_mu_;
  std::unordered_map<MempoolId, ForeignPool, MempoolHash> foreign_pools_;
  std::vector<ForeignRoute> routes_;
  std::unordered_map<void*, ForeignBlock> foreign_ptrs_;
  uint64_t next_seq_ = 0;
  std::atomic<int> foreign_routes_{0};
  std::atomic<int> foreign_live_{0};
};

}  // namespace
}  // namespace symm_torch
