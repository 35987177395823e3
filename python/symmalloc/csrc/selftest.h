// symmalloc's C++ allocator for PyTorch: its checks on the host backend (CI, no GPU).
// Included by torch_allocator.cpp only (symm_torch_selftest runs them).
//
// Owns: the checks of the allocator object's methods that take a device, run against
// libsymmalloc on host memory without installing it (no CUDA runtime is needed): statistics,
// DataPtrs and the raw deleter, out of memory (the observers' arguments), cacheInfo, a private
// pool's checkpoint and restore, snapshot and history (segment entries of grown segments,
// released pools and trims), CUDA IPC's handles (ipc_selftest.h), history under threads (a
// stand-in GIL that a recorder called under an allocator lock deadlocks on), caching off, and
// what is refused by name (what newer torch minors add: selftest_recent.h); and the cost of a
// free before, during and after recording (time_frees, printed on request).
//
// Invariants:
// - Each check is named by the failure it reports; the first failure ends the run.
// - Every block the checks make is freed and every pool released before they return, when they
//   hold (the allocator is the one symm_torch_selftest made, never PyTorch's).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "api.h"
#include "ipc_selftest.h"
#include "oom.h"
#include "selftest_recent.h"

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

// `iters` allocations of 512 bytes to 3 MiB (small and large) on `device`, a few held at a time
// and freed in a pseudo-random order given by `seed`, then the rest freed: the host tests' load
// (symm_torch_host_churn). "" or what was thrown.
template <typename Allocator>
std::string churn(Allocator& a, int device, int iters, uint64_t seed) {
  std::vector<void*> held;
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  try {
    for (int i = 0; i < iters; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      held.push_back(a.malloc_on(device, 512 + (size_t)((x >> 33) % (3 << 20)), nullptr));
      if (held.size() > 8 || ((x >> 17) & 1)) {
        size_t k = (size_t)((x >> 20) % held.size());
        a.raw_delete(held[k]);
        held.erase(held.begin() + (long)k);
      }
    }
  } catch (const std::exception& e) {
    for (void* p : held) a.raw_delete(p);
    return std::string("churn: ") + e.what();
  }
  for (void* p : held) a.raw_delete(p);
  return "";
}

// A stand-in for the GIL: the recorder below takes it, as PyTorch's Python recorder takes the
// GIL, and the snapshot thread of selftest_threads holds it while it takes a snapshot, as
// torch.cuda.memory._snapshot holds the GIL. Fair, as the GIL is (a waiting thread asks the
// holder to drop it and gets it next): tickets served in order. A plain std::mutex is not; the
// snapshot thread, taking it again the moment it lets go, could keep an allocating thread
// waiting for a minute on a loaded 2-core machine, which read as a deadlock.
class FairGil {
 public:
  void lock() {
    std::unique_lock<std::mutex> l(mu_);
    uint64_t mine = next_++;
    cv_.wait(l, [&] { return serving_ == mine; });
  }
  void unlock() {
    {
      std::lock_guard<std::mutex> l(mu_);
      ++serving_;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ = 0, serving_ = 0;
};
inline FairGil& gil() {
  static auto* m = new FairGil();
  return *m;
}
inline std::shared_ptr<c10::GatheredContext> gil_recorder() {
  std::lock_guard<FairGil> g(gil());
  return std::make_shared<c10::GatheredContext>();
}

// A recorder for host tests that calls `host_hook()` (a Python callback through ctypes, which
// takes the GIL as PyTorch's Python recorder does), then returns an empty context.
using HostHook = void (*)();
inline std::atomic<HostHook>& host_hook() {
  static auto* h = new std::atomic<HostHook>(nullptr);
  return *h;
}
inline std::shared_ptr<c10::GatheredContext> hook_recorder() {
  if (HostHook h = host_hook().load()) h();
  return std::make_shared<c10::GatheredContext>();
}

// A snapshot with its trace, counted: (segments, allocations in the trace with frames).
template <typename Allocator>
std::pair<size_t, size_t> snapshot_counts(Allocator& a) {
  auto snap = a.snapshot({0, 0}, true);
  size_t allocs = 0;
  for (const auto& tr : snap.device_traces)
    for (const auto& te : tr) allocs += te.action_ == TraceEntry::ALLOC && te.context_ != nullptr;
  return {snap.segments.size(), allocs};
}

// History under threads: two threads allocate and free (at least `iters` each, and on until
// the third has taken 20 snapshots, at most 50 times `iters`) while a third takes snapshots holding the stand-in GIL,
// history recorded with the recorder that takes it. A recorder called under an allocator lock
// deadlocks here. "" when all finish within
// `timeout_s` and the trace holds their events; else why (the threads then stay behind,
// detached: the caller's process must end).
template <typename Allocator>
std::string selftest_threads(Allocator& a, int device, int iters, double timeout_s) {
  struct State {
    std::atomic<int> workers_done{0};
    std::atomic<int64_t> allocations{0};
    std::atomic<bool> stop{false}, snapper_done{false};
    std::atomic<size_t> snapshots{0};
    std::mutex mu;
    std::string failure;
  };
  auto st = std::make_shared<State>();  // shared with the threads: outlives a timeout
  a.recordHistory(true, &gil_recorder, (size_t)1 << 22, CCA::RecordContext::ALL, true, {});
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w)
    threads.emplace_back([&a, st, device, iters, w] {
      // At most 50 times `iters`: the trace ring below holds them all.
      for (int done = 0, round = 0;
           done < 50 * iters && (done < iters || st->snapshots.load() < 20); done += 50) {
        std::string f = churn(a, device, 50, (uint64_t)(w * 100000 + round++));
        st->allocations += 50;
        if (!f.empty()) {
          std::lock_guard<std::mutex> g(st->mu);
          st->failure = f;
          break;
        }
      }
      st->workers_done++;
    });
  threads.emplace_back([&a, st] {
    while (!st->stop.load()) {
      std::lock_guard<FairGil> g(gil());
      (void)a.snapshot({0, 0}, true);
      st->snapshots++;
    }
    st->snapper_done = true;
  });
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds((int64_t)(timeout_s * 1000));
  while (st->workers_done.load() < 2 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  st->stop = true;
  // The snapshot thread ends after the snapshot it is taking: 10 s more at most.
  auto grace = std::max(deadline, std::chrono::steady_clock::now()) + std::chrono::seconds(10);
  while (!st->snapper_done.load() && std::chrono::steady_clock::now() < grace)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  if (st->workers_done.load() < 2 || !st->snapper_done.load()) {
    for (auto& t : threads) t.detach();
    return "selftest: history under threads: " + std::to_string(st->workers_done.load()) +
           " of 2 allocating threads finished in " + std::to_string(timeout_s) + " s, and " +
           (st->snapper_done ? "the" : "not the") + " snapshot thread 10 s after (" +
           std::to_string(st->allocations.load()) + " allocations, " +
           std::to_string(st->snapshots.load()) +
           " snapshots taken; a deadlock: frames gathered under an allocator lock?)";
  }
  for (auto& t : threads) t.join();
  size_t allocs = 0, frees = 0;
  for (const auto& tr : a.snapshot({0, 0}, true).device_traces)
    for (const auto& te : tr) {
      allocs += te.action_ == TraceEntry::ALLOC && te.context_ != nullptr;
      frees += te.action_ == TraceEntry::FREE_COMPLETED && te.context_ != nullptr;
    }
  a.recordHistory(false, nullptr, 0, CCA::RecordContext::NEVER, true, {});
  if (!st->failure.empty()) return "selftest: history under threads: " + st->failure;
  if (st->snapshots.load() == 0) return "selftest: history under threads: no snapshot taken";
  size_t want = (size_t)st->allocations.load();
  if (allocs != want || frees != want)
    return "selftest: history under threads: the trace holds " + std::to_string(allocs) +
           " allocations and " + std::to_string(frees) + " frees with frames; expected " +
           std::to_string(want) + " of each";
  return "";
}

// The cost of a free before, during and after recording, on the host backend: ns per free
// (malloc of 4 KiB outside the timing), a line for the report (SYMM_TORCH_SELFTEST_TIMING).
template <typename Allocator>
std::string time_frees(Allocator& a, int device) {
  constexpr int kBatch = 1000, kRounds = 200;
  auto per_free = [&] {
    std::vector<void*> v(kBatch);
    double best = 1e30;
    for (int r = 0; r < kRounds; ++r) {
      for (auto& p : v) p = a.malloc_on(device, 4096, nullptr);
      auto t0 = std::chrono::steady_clock::now();
      for (void* p : v) a.raw_delete(p);
      auto t1 = std::chrono::steady_clock::now();
      best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count() / kBatch);
    }
    return best;
  };
  double before = per_free();
  a.recordHistory(true, [] { return std::make_shared<c10::GatheredContext>(); }, 1 << 20,
                  CCA::RecordContext::STATE, true, {});
  double during = per_free();
  std::vector<void*> kept;  // 1000 blocks with contexts, alive after recording stops
  for (int i = 0; i < 1000; ++i) kept.push_back(a.malloc_on(device, 4096, nullptr));
  a.recordHistory(false, nullptr, 0, CCA::RecordContext::NEVER, true, {});
  double after_live = per_free();
  for (void* p : kept) a.raw_delete(p);
  double after = per_free();
  char line[256];
  std::snprintf(line, sizeof line,
                "free of 4 KiB, ns (best of %d rounds of %d): before recording %.1f, during "
                "(state contexts) %.1f, after with 1000 recorded blocks alive %.1f, after %.1f",
                kRounds, kBatch, before, during, after_live, after);
  return line;
}

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
  largest = 1;  // nonzero: PyTorch's cacheInfo starts from it instead of the free memory
  a.cacheInfo(device, &largest);
  EXPECT(largest >= (3u << 20) && largest < (64u << 20), "cacheInfo starts from *largest");
  largest = (size_t)1 << 40;
  a.cacheInfo(device, &largest);
  EXPECT(largest == (size_t)1 << 40, "cacheInfo never lowers *largest");

  // Out of memory: PyTorch's error type, counted, observers called, nothing lost.
  void* keep = a.malloc_on(device, 4096, nullptr);
  std::memset(keep, 0x5A, 4096);
  // The observer stays attached after the checks: what it writes outlives them.
  auto oom_args = std::make_shared<std::vector<int64_t>>();
  a.attachOutOfMemoryObserver([oom_args](int64_t d, size_t alloc, size_t total, size_t free_b) {
    oom_args->insert(oom_args->end(), {d, (int64_t)alloc, (int64_t)total, (int64_t)free_b});
  });
  a.set_limit(device, 0.5, (size_t)64 << 20);  // 32 MiB of a pretend 64 MiB device
  bool threw = false;
  try {
    a.malloc_on(device, (size_t)48 << 20, nullptr);
  } catch (const c10::OutOfMemoryError& e) {
    threw = std::string(e.what()).find("CUDA out of memory. Tried to allocate 48.00 MiB") !=
            std::string::npos;
  }
  EXPECT(threw, "a request past the memory fraction raises OutOfMemoryError");
  EXPECT(oom_args->size() == 4, "the out-of-memory observer was called once");
  // PyTorch's arguments: device, the segment its allocator would have asked for (48 MiB,
  // rounded to 2 MiB), the cap set_per_process_memory_fraction set (32 MiB) rather than the
  // device's total, and the device's free memory (none known on the host backend).
  EXPECT((*oom_args)[0] == device && (*oom_args)[1] == (48 << 20) && (*oom_args)[2] == (32 << 20) &&
             (*oom_args)[3] == 0,
         "the observer gets (device, allocation size, allowed bytes, free bytes): got (" +
             std::to_string((*oom_args)[0]) + ", " + std::to_string((*oom_args)[1]) + ", " +
             std::to_string((*oom_args)[2]) + ", " + std::to_string((*oom_args)[3]) + ")");
  EXPECT(allocation_size(1000) == (2 << 20) && allocation_size(3 << 20) == (20 << 20) &&
             allocation_size((10 << 20) + 1) == (12 << 20),
         "allocation sizes as PyTorch's allocator makes them");
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
  {
    // PyTorch's cacheInfo counts the free blocks of private pools too: a 40 MiB free block
    // of this pool, larger than anything the default pool caches.
    a.beginAllocateToPool(device, pool, [](cudaStream_t) { return true; });
    void* big = a.malloc_on(device, 40 << 20, nullptr);
    a.endAllocateToPool(device, pool);
    a.raw_delete(big);
    size_t most = 1;
    a.cacheInfo(device, &most);
    EXPECT(most >= (40u << 20), "cacheInfo counts a private pool's free block: " +
                                    std::to_string(most));
    a.releasePool(device, pool);  // the begin's use
  }
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
  for (size_t i = 0; i < snap.segments.size(); ++i) {
    EXPECT(i == 0 || snap.segments[i].address > snap.segments[i - 1].address,
           "segments in address order");
#if SYMM_TORCH_HAS_REGISTRATION_COUNTER
    EXPECT(snap.segments[i].registration_counter == (int32_t)i,
           "segments counted in address order (registration_counter)");
#endif
  }
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

  // Segment entries as PyTorch emits them: a segment made (segment_alloc), grown in place
  // (segment_map of the range mapped after it), given back at a pool's release (segment_unmap
  // of that range, then segment_free of what segment_alloc named); and an emptyCache trim.
  {
    a.emptyCache({0, 0});  // no cached segment for the pool to adopt
    a.recordHistory(true, nullptr, 1000, CCA::RecordContext::NEVER, true, {});
    MempoolId grown_pool{0, 9002};
    a.createOrIncrefPool(device, grown_pool, nullptr);
    a.beginAllocateToPool(device, grown_pool, [](cudaStream_t) { return true; });
    void* s1 = a.malloc_on(device, 12 << 20, nullptr);
    a.raw_delete(s1);
    void* s2 = a.malloc_on(device, 14 << 20, nullptr);
    a.endAllocateToPool(device, grown_pool);
    EXPECT(s2 == s1, "the pool's segment grew in place");
    a.raw_delete(s2);
    a.releasePool(device, grown_pool);
    a.releasePool(device, grown_pool);
    void* t1 = a.malloc_on(device, 16 << 20, nullptr);
    a.raw_delete(t1);
    a.emptyCache({0, 0});
    std::vector<std::string> got;
    uint64_t seg = (uint64_t)s1;
    for (const auto& tr : a.snapshot({0, 0}, true).device_traces)
      for (const auto& te : tr) {
        if (te.action_ < TraceEntry::SEGMENT_ALLOC || te.action_ > TraceEntry::SEGMENT_UNMAP)
          continue;
        std::string at = te.addr_ == (uint64_t)t1 && te.size_ == (16 << 20) ? "t1"
                         : te.addr_ == seg                                   ? "seg"
                         : te.addr_ == seg + (12 << 20)                      ? "seg+12M"
                                                                             : std::to_string(te.addr_);
        got.push_back(std::to_string((int)te.action_) + "@" + at + ":" +
                      std::to_string(te.size_ >> 20) + "M");
      }
    std::string want = "3@seg:12M 5@seg+12M:2M 6@seg+12M:2M 4@seg:12M 3@t1:16M 4@t1:16M";
    std::string have;
    for (const auto& g : got) have += (have.empty() ? "" : " ") + g;
    EXPECT(have == want, "segment entries (3 alloc, 4 free, 5 map, 6 unmap): want " + want +
                             ", got " + have);
    a.recordHistory(false, nullptr, 0, CCA::RecordContext::NEVER, true, {});
  }

  // Caching off: every free gives the memory back.
  a.enable(false);
  EXPECT(!a.isEnabled(), "caching reported off");
  void* c = a.malloc_on(device, 30 << 20, nullptr);
  int64_t held = a.getDeviceStats(device).reserved_bytes[0].current;
  a.raw_delete(c);
  EXPECT(a.getDeviceStats(device).reserved_bytes[0].current < held, "memory went back at the free");
  a.enable(true);

  // What is refused, by name.
  std::string ipc = selftest_ipc(a, device);  // CUDA IPC (ipc_selftest.h)
  if (!ipc.empty()) return ipc;
  bool named = false;
  try {
    a.setNoSplit(device, pool);
  } catch (const c10::Error& e) {
    named = std::string(e.what()).find("no_split") != std::string::npos;
  }
  EXPECT(named, "setNoSplit names the option");
  EXPECT(a.name() == "symmalloc", "name");
#undef EXPECT
  std::string recent = selftest_recent(a, device);  // selftest_recent.h
  if (!recent.empty()) return recent;
  std::string threads = selftest_threads(a, device, 400, 60.0);
  if (!threads.empty()) return threads;
  if (std::getenv("SYMM_TORCH_SELFTEST_TIMING")) std::fprintf(stderr, "%s\n", time_frees(a, device).c_str());
  return "";
}

}  // namespace
}  // namespace symm_torch
