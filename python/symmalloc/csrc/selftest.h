// symmalloc's C++ allocator for PyTorch: its checks on the host backend (CI, no GPU).
// Included by torch_allocator.cpp only (symm_torch_selftest runs them).
//
// Owns: the checks of the allocator object's methods that take a device, run against
// libsymmalloc on host memory without installing it (no CUDA runtime is needed): statistics,
// DataPtrs and the raw deleter, out of memory, a private pool's checkpoint and restore,
// snapshot and history, caching off, and what is refused by name.
//
// Invariants:
// - Each check is named by the failure it reports; the first failure ends the run.
// - Every block the checks make is freed and every pool released before they return, when they
//   hold (the allocator is the one symm_torch_selftest made, never PyTorch's).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "api.h"

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

// The checks on `device` of `a` (torch_allocator.cpp's SymmAllocator, a template only so that
// this file needs nothing of it): "" when every one held, else the first failure. Throws what
// the allocator throws unexpectedly (the caller reports it).
template <typename Allocator>
std::string selftest(Allocator& a, int device) {
  a.init(8);
#define EXPECT(cond, what) \
  if (!(cond)) return std::string("selftest: ") + what
  auto s0 = a.getDeviceStats(device);
  void* p = a.malloc_on(device, 1000, nullptr);
  void* q = a.malloc_on(device, 3 << 20, nullptr);
  auto s1 = a.getDeviceStats(device);
  EXPECT(s1.allocation[0].current == s0.allocation[0].current + 2, "two allocations counted");
  EXPECT(s1.allocated_bytes[0].current == s0.allocated_bytes[0].current + 1024 + (3 << 20),
         "allocated bytes are the blocks' sizes");
  EXPECT(s1.requested_bytes[0].current == s0.requested_bytes[0].current + 1000 + (3 << 20),
         "requested bytes are the requests");
  EXPECT(s1.max_split_size == -1, "max_split_size is -1");
  // A DataPtr as PyTorch's allocator makes it: ctx is the address, the raw deleter frees.
  c10::DataPtr dp(p, p, a.raw_deleter(), c10::Device(c10::DeviceType::CUDA, device));
  dp.clear();
  a.raw_delete(q);
  auto s2 = a.getDeviceStats(device);
  EXPECT(s2.allocation[0].current == s0.allocation[0].current, "both freed");
  EXPECT(s2.allocated_bytes[0].peak >= s1.allocated_bytes[0].current, "peak kept");
  a.resetPeakStats(device);
  a.resetAccumulatedStats(device);
  auto s3 = a.getDeviceStats(device);
  EXPECT(s3.allocated_bytes[0].peak == s3.allocated_bytes[0].current, "peak reset");
  EXPECT(s3.allocation[0].allocated == 0 && s3.num_ooms == 0, "accumulated reset");
  size_t largest = 0;
  a.cacheInfo(device, &largest);
  EXPECT(largest >= (3u << 20), "cacheInfo sees the cached large block");

  // Out of memory: PyTorch's error type, counted, observers called, nothing lost.
  void* keep = a.malloc_on(device, 4096, nullptr);
  std::memset(keep, 0x5A, 4096);
  int observed = 0;
  a.attachOutOfMemoryObserver([&](int64_t, size_t, size_t, size_t) { ++observed; });
  a.set_limit(device, 0.5, (size_t)64 << 20);  // 32 MiB of a pretend 64 MiB device
  bool threw = false;
  try {
    a.malloc_on(device, (size_t)48 << 20, nullptr);
  } catch (const c10::OutOfMemoryError& e) {
    threw = std::string(e.what()).find("CUDA out of memory. Tried to allocate 48.00 MiB") !=
            std::string::npos;
  }
  EXPECT(threw, "a request past the memory fraction raises OutOfMemoryError");
  EXPECT(observed == 1, "the out-of-memory observer was called once");
  EXPECT(a.getDeviceStats(device).num_ooms == 1,
         "num_ooms counts it: " + std::to_string(a.getDeviceStats(device).num_ooms));
  EXPECT(a.getMemoryFraction(device) == 0.5, "the fraction is kept");
  for (int i = 0; i < 4096; ++i)
    EXPECT(static_cast<unsigned char*>(keep)[i] == 0x5A, "a live block was disturbed");
  a.set_limit(device, 1.0, (size_t)64 << 20);
  void* big = a.malloc_on(device, (size_t)48 << 20, nullptr);
  a.raw_delete(big);
  a.raw_delete(keep);

  // A private pool as a graph capture uses it, checked and restored as CUDA-graph trees do.
  MempoolId pool{0, 9001};
  a.createOrIncrefPool(device, pool, nullptr);
  EXPECT(a.getPoolUseCount(device, pool) == 1, "createOrIncrefPool takes a use");
  a.beginAllocateToPool(device, pool, [](cudaStream_t) { return true; });
  void* x = a.malloc_on(device, 2 << 20, nullptr);
  void* y = a.malloc_on(device, 512, nullptr);
  a.endAllocateToPool(device, pool);
  EXPECT(a.checkPoolLiveAllocations(device, pool, {x, y}), "pool holds x and y");
  EXPECT(!a.checkPoolLiveAllocations(device, pool, {x}), "a missing block is seen");
  auto ck = a.getCheckpointState(device, pool);
  a.raw_delete(y);
  EXPECT(a.checkPoolLiveAllocations(device, pool, {x}), "y freed");
  auto delta = a.setCheckpointPoolState(device, ck);
  EXPECT(delta.ptrs_freed.size() == 1 && delta.ptrs_freed[0] == x, "x freed by the restore");
  EXPECT(delta.dataptrs_allocd.size() == 2, "x and y allocated again");
  EXPECT(a.checkPoolLiveAllocations(device, pool, {x, y}), "pool back at its checkpoint");
  for (auto& d : delta.dataptrs_allocd)
    EXPECT(d.get_deleter() == a.raw_deleter() && d.get_context() == d.get(),
           "restored DataPtrs carry the raw deleter");
  delta.dataptrs_allocd.clear();  // frees x and y through the deleter
  EXPECT(a.checkPoolLiveAllocations(device, pool, {}), "restored blocks freed");
  a.setUseOnOOM(device, pool, false);
  // A MemPool's destructor: releasePool, then emptyCache of that pool alone; the default
  // pool's cached segment (of `z`, freed) stays until an emptyCache of the whole cache.
  void* z = a.malloc_on(device, 6 << 20, nullptr);
  a.raw_delete(z);
  a.releasePool(device, pool);
  a.releasePool(device, pool);  // the begin's use: the pool's segments go back here
  int64_t cached = a.getDeviceStats(device).reserved_bytes[0].current;
  a.emptyCache(pool);
  EXPECT(a.getDeviceStats(device).reserved_bytes[0].current == cached,
         "emptyCache of a pool's id leaves the default pool's cache");
  a.emptyCache({0, 0});
  EXPECT(a.getDeviceStats(device).reserved_bytes[0].current < cached,
         "emptyCache of the whole cache gives the default pool's free segment back");

  // Snapshot and history: segments with their blocks, a trace ring with alloc and free.
  a.recordHistory(true, nullptr, 100, CCA::RecordContext::STATE, true, {});
  void* h = a.malloc_on(device, 8 << 20, nullptr);
  auto snap = a.snapshot({0, 0}, true);
  bool seen = false;
  for (const auto& seg : snap.segments) {
    size_t sum = 0, at = 0;
    for (const auto& b : seg.blocks) {
      sum += b.size;
      if (b.allocated && seg.address + at == (uint64_t)h) seen = b.requested_size == (8u << 20);
      at += b.size;
    }
    EXPECT(sum == seg.total_size, "blocks tile their segment");
  }
  EXPECT(seen, "the live block is in the snapshot");
  a.raw_delete(h);
  snap = a.snapshot({0, 0}, true);
  size_t allocs = 0, frees = 0;
  for (const auto& tr : snap.device_traces)
    for (const auto& te : tr) {
      allocs += te.action_ == TraceEntry::ALLOC && te.addr_ == (uint64_t)h;
      frees += te.action_ == TraceEntry::FREE_COMPLETED && te.addr_ == (uint64_t)h;
    }
  EXPECT(allocs == 1 && frees == 1, "the trace holds the alloc and the free");
  a.setUserMetadata("step 7");
  void* h2 = a.malloc_on(device, 4096, nullptr);
  a.raw_delete(h2);
  snap = a.snapshot({0, 0}, true);
  bool tagged = false;
  for (const auto& tr : snap.device_traces)
    for (const auto& te : tr) tagged |= te.addr_ == (uint64_t)h2 && te.user_metadata_ == "step 7";
  EXPECT(tagged, "trace entries carry the user metadata");
  a.setUserMetadata("");
  a.recordHistory(false, nullptr, 0, CCA::RecordContext::NEVER, true, {});

  // As PyTorch's: a live block keeps its context after history is switched off (CUDA-graph
  // trees name a leaked block by its frames after recording), and drops it when freed.
  auto context_at = [&](void* p) -> std::shared_ptr<c10::GatheredContext> {
    for (const auto& seg : a.snapshot({0, 0}, false).segments) {
      size_t at = 0;
      for (const auto& b : seg.blocks) {
        if (b.allocated && seg.address + at == (uint64_t)p) return b.context_when_allocated;
        at += b.size;
      }
    }
    return nullptr;
  };
  a.recordHistory(true, [] { return std::make_shared<c10::GatheredContext>(); }, 100,
                  CCA::RecordContext::STATE, true, {});
  void* h3 = a.malloc_on(device, 4096, nullptr);
  a.recordHistory(false, nullptr, 0, CCA::RecordContext::NEVER, false, {});
  EXPECT(context_at(h3) != nullptr, "a live block keeps its context with history off");
  EXPECT(a.snapshot({0, 0}, true).device_traces.empty() ||
             a.snapshot({0, 0}, true).device_traces[device].empty(),
         "switching history off empties the trace");
  a.raw_delete(h3);
  void* h4 = a.malloc_on(device, 4096, nullptr);
  EXPECT(context_at(h4) == nullptr, "a freed block's context is dropped, not inherited");
  a.raw_delete(h4);

  // A segment given back outside emptyCache (caching off: at the free) leaves no frames for a
  // new segment at its address (set or cleared at each segment event; pruned at snapshots).
  auto segment_context_at = [&](void* p, bool* found) -> std::shared_ptr<c10::GatheredContext> {
    *found = false;
    for (const auto& seg : a.snapshot({0, 0}, false).segments)
      if ((uint64_t)p >= seg.address && (uint64_t)p < seg.address + seg.total_size) {
        *found = true;
        return seg.context_when_allocated;
      }
    return nullptr;
  };
  bool found = false;
  a.emptyCache({0, 0});  // no cached segment to serve from: the next one is new
  a.enable(false);
  a.recordHistory(true, [] { return std::make_shared<c10::GatheredContext>(); }, 100,
                  CCA::RecordContext::STATE, true, {});
  void* g1 = a.malloc_on(device, 30 << 20, nullptr);
  EXPECT(segment_context_at(g1, &found) != nullptr && found, "a new segment has its context");
  bool framed = false, segment_traced = false;
  for (const auto& tr : a.snapshot({0, 0}, true).device_traces)
    for (const auto& te : tr) {
      framed |= te.context_ != nullptr;
      segment_traced |= te.action_ == TraceEntry::SEGMENT_ALLOC;
    }
  EXPECT(segment_traced && !framed,
         "context=state: trace entries (the segment_alloc among them) carry no frames");
  a.raw_delete(g1);
  a.recordHistory(true, [] { return std::make_shared<c10::GatheredContext>(); }, 100,
                  CCA::RecordContext::NEVER, true, {});
  void* g2 = a.malloc_on(device, 30 << 20, nullptr);
  EXPECT(g2 == g1, "the host heap maps the same address again (the check below needs it)");
  EXPECT(segment_context_at(g2, &found) == nullptr && found,
         "a segment remade at a given-back segment's address does not inherit its frames");
  a.raw_delete(g2);
  a.recordHistory(false, nullptr, 0, CCA::RecordContext::NEVER, true, {});
  a.enable(true);

  // Caching off: every free gives the memory back.
  a.enable(false);
  EXPECT(!a.isEnabled(), "caching reported off");
  void* c = a.malloc_on(device, 30 << 20, nullptr);
  int64_t held = a.getDeviceStats(device).reserved_bytes[0].current;
  a.raw_delete(c);
  EXPECT(a.getDeviceStats(device).reserved_bytes[0].current < held, "memory went back at the free");
  a.enable(true);

  // What is refused, by name.
  bool named = false;
  try {
    a.shareIpcHandle(x);
  } catch (const c10::Error& e) {
    named = std::string(e.what()).find("torch.multiprocessing") != std::string::npos;
  }
  EXPECT(named, "shareIpcHandle names what to do");
  named = false;
  try {
    a.setNoSplit(device, pool);
  } catch (const c10::Error& e) {
    named = std::string(e.what()).find("no_split") != std::string::npos;
  }
  EXPECT(named, "setNoSplit names the option");
  EXPECT(a.name() == "symmalloc", "name");
#undef EXPECT
  return "";
}

}  // namespace
}  // namespace symm_torch
