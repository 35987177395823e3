// symmalloc's C++ allocator for PyTorch: what PyTorch's allocator records beside its heap.
// Included by torch_allocator.cpp only.
//
// Owns: the memory history (torch.cuda.memory._record_memory_history: the trace ring, the
// live blocks seen allocated while recording with their contexts, the context of each
// segment), the allocator trace trackers and out-of-memory observers, the memory cap each
// device's observers are told, the compile context and user metadata each trace entry carries,
// and the snapshot (torch.cuda.memory._snapshot) assembled from the heap's blocks and these.
// Segment entries (SEGMENT_ALLOC, SEGMENT_MAP, SEGMENT_FREE) come from libsymmalloc's segment
// event log (symm_segment_events), on while it is needed.
//
// Invariants:
// - Frames are gathered (`gather`, the recorder: PyTorch's takes the GIL) with no lock of the
//   allocator held, neither `history_mu_` nor a heap's, as PyTorch's allocator does: a thread
//   holding the GIL may wait on `history_mu_` (a snapshot) while another allocates.
// - Everything here but the atomics is read and written under `history_mu_`; nothing under it
//   calls Python. Trackers are called under it, as PyTorch calls them under its own lock.
// - `active_` is true while history is recorded or a tracker listens: then every allocation
//   and free is an event. The allocation path reads it with one relaxed load; the free path
//   reads it and, when it is false, `tracked_` (live blocks holding a context): with none, a
//   free costs that one more load; with some, a load of the address filter's slot, and only a
//   free whose slot is taken comes in here (a hash lookup). No path walks the heap's blocks.
// - As PyTorch's, a live block keeps its context until it is freed, history on or off; a
//   segment keeps its context until it is given back (the event log stays on while any does).
// - Switching history off empties the trace ring only (PyTorch's `recordHistory`).
// - Nothing here places memory: it reads the heap's blocks, statistics and segment events.
// - Segment events are taken in the heap's order, by whichever thread comes next (an
//   allocation, a free, emptyCache, releasePool, an out of memory): with several threads
//   allocating at once, a segment entry may carry another thread's stream and frames.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "api.h"

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

// A counting filter over block addresses: `may_hold(p)` is true for every address added and not
// yet removed, and false for most others (those that share a slot with one: about n / 65536 of
// them for n added). Slots are made at the first add and never freed (the allocator is never
// destroyed); reads are lock-free, writes under the history lock.
class AddressFilter {
 public:
  bool may_hold(const void* p) const {
    auto* s = slots_.load(std::memory_order_acquire);
    return s != nullptr && s[slot(p)].load(std::memory_order_relaxed) != 0;
  }
  void add(const void* p) {
    auto* s = slots_.load(std::memory_order_relaxed);
    if (s == nullptr) {
      s = new std::atomic<uint32_t>[kSlots]();
      slots_.store(s, std::memory_order_release);
    }
    s[slot(p)].fetch_add(1, std::memory_order_relaxed);
  }
  void remove(const void* p) {
    slots_.load(std::memory_order_relaxed)[slot(p)].fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  static constexpr size_t kBits = 16, kSlots = size_t(1) << kBits;
  static size_t slot(const void* p) {
    // Blocks are 512-byte aligned: mix the bits above.
    return (size_t)((((uintptr_t)p >> 9) * 0x9E3779B97F4A7C15ull) >> (64 - kBits));
  }
  std::atomic<std::atomic<uint32_t>*> slots_{nullptr};
};

class History {
 public:
  // Every allocation and free is an event (history recorded, or a tracker listening).
  bool active() const { return active_.load(std::memory_order_relaxed); }

  // Whether the free of `p` must call note_free: active, or `p` may hold a recorded context.
  bool wants_free(const void* p) const {
    if (active_.load(std::memory_order_relaxed)) return true;
    return tracked_.load(std::memory_order_relaxed) > 0 && filter_.may_hold(p);
  }

  // Frames for an event recorded at `at_least` or finer (PyTorch's maybeGatherContext). Call
  // with no lock of the allocator held: the recorder may take the GIL.
  std::shared_ptr<c10::GatheredContext> gather(CCA::RecordContext at_least) const {
    CCA::CreateContextFn recorder = recorder_.load(std::memory_order_acquire);
    if (recorder == nullptr || when_.load(std::memory_order_relaxed) < (int)at_least)
      return nullptr;
    return recorder();
  }

  // ---- snapshots and history (the allocator's methods of the same names) ----
  CCA::SnapshotInfo snapshot(int device_count, MempoolId mempool_id, bool include_traces) {
    CCA::SnapshotInfo out;
    bool one_pool = mempool_id.first != 0 || mempool_id.second != 0;
    std::lock_guard<std::mutex> g(history_mu_);
    // Segment contexts as of now. While active, the allocating or freeing thread takes its
    // events itself (with its stream and frames), right after its call into the heap.
    if (!active_.load()) drain_segments(nullptr, nullptr);
    for_each_heap(device_count, one_pool ? &mempool_id : nullptr,
                  [&](int d, const std::vector<SymmBlock>& blocks) {
      CCA::SegmentInfo* seg = nullptr;
      for (const auto& b : blocks) {
        if (!seg || seg->address != b.segment_address) {
          out.segments.emplace_back();
          seg = &out.segments.back();
          seg->device = (c10::DeviceIndex)d;
          seg->address = b.segment_address;
          seg->total_size = b.segment_size;
          seg->stream = (TraceStream)(uintptr_t)(b.stream == UINT64_MAX ? 0 : b.stream);
          seg->is_large = b.is_large != 0;
          seg->is_expandable = false;
          seg->owner_private_pool_id = {b.pool_first, b.pool_second};
          // Address order: the same on every rank (symmetric placement), as NCCL's symmetric
          // registration needs when it walks a pool's segments by this counter.
#if SYMM_TORCH_HAS_REGISTRATION_COUNTER
          seg->registration_counter = (int32_t)out.segments.size() - 1;
#endif
          auto sc = segment_ctx_.find(b.segment_address);
          if (sc != segment_ctx_.end()) seg->context_when_allocated = sc->second;
        }
        BlockInfo bi;
        bi.size = b.size;
        bi.requested_size = b.requested;
        bi.allocated = b.state == kBlockLive;
        bi.active = bi.allocated;
        if (bi.allocated) {
          auto c = live_.find((void*)b.address);
          if (c != live_.end()) bi.context_when_allocated = c->second.ctx;
          seg->allocated_size += b.size;
          seg->active_size += b.size;
          seg->requested_size += b.requested;
        }
        seg->blocks.push_back(std::move(bi));
      }
      return false;
    });
    if (!one_pool) {
      // Entries of segments that are gone (given back while nothing was logged) go with them.
      std::set<uint64_t> present;
      for (const auto& s : out.segments) present.insert(s.address);
      for (auto it = segment_ctx_.begin(); it != segment_ctx_.end();)
        it = present.count(it->first) ? std::next(it) : segment_ctx_.erase(it);
      update_state();
    }
    auto to_us = clock_.makeConverter();
    if (include_traces) {
      out.device_traces.resize(std::max(device_count, 1));
      for (const auto& te : ring_) {
        if ((size_t)te.device_ < out.device_traces.size()) {
          out.device_traces[te.device_].push_back(te);
          auto& e = out.device_traces[te.device_].back();
          e.time_.t_ = to_us(e.time_.approx_t_);
        }
      }
    }
    auto& cfg = out.config_metadata;
    cfg.garbage_collection_threshold = 0;
    cfg.max_split_size = SIZE_MAX;
    cfg.pinned_num_register_threads = 1;
    cfg.expandable_segments = false;
    cfg.release_lock_on_malloc = false;
    cfg.pinned_use_host_register = false;
    cfg.graph_capture_record_stream_reuse = false;
    cfg.last_allocator_settings = "symmalloc";
    return out;
  }

  bool isHistoryEnabled() {
    std::lock_guard<std::mutex> g(history_mu_);
    return history_;
  }

  // One line for diagnosis (symm_torch_history_state): what is recorded and how much is kept.
  std::string state() {
    std::lock_guard<std::mutex> g(history_mu_);
    std::string skip;
    for (const auto& s : skip_) skip += (skip.empty() ? "" : ",") + s;
    std::map<int, size_t> per_device;  // the ring's entries by device index (snapshot keeps
    for (const auto& te : ring_) per_device[(int)te.device_]++;  // those below device_count)
    std::string devices;
    for (const auto& [d, n] : per_device)
      devices += (devices.empty() ? "" : " ") + std::to_string(d) + ":" + std::to_string(n);
    return "history " + std::to_string(history_) + ", recording " +
           std::to_string(active_.load()) + ", when " + std::to_string(when_.load()) +
           ", recorder " + std::to_string(recorder_.load() != nullptr) + ", ring " +
           std::to_string(ring_.size()) + " of " + std::to_string(max_entries_) +
           " (by device " + devices + ")" +
           ", skip [" + skip + "], trackers " + std::to_string(trackers_.size()) +
           ", live " + std::to_string(live_.size()) + ", contexts " +
           std::to_string(tracked_.load()) + ", segment contexts " +
           std::to_string(segment_ctx_.size()) + ", segment log " + std::to_string(log_on_);
  }

  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CCA::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) {
    std::lock_guard<std::mutex> g(history_mu_);
    // Events logged before this belong to the old setting: taken now, under it.
    drain_segments(nullptr, nullptr);
    // As PyTorch's allocator: switching off (or clearHistory) empties the trace ring; the
    // contexts of live blocks and segments stay with them until they are freed (CUDA-graph
    // trees switch history off after a capture, then name a leaked block by its frames).
    recorder_.store(enabled ? context_recorder : nullptr, std::memory_order_release);
    max_entries_ = std::max<size_t>(alloc_trace_max_entries, 1);
    when_.store(enabled ? (int)when : (int)CCA::RecordContext::NEVER);
    skip_.clear();
    for (const auto& a : skip_actions) skip_.insert(a);
    if (clearHistory || !enabled) ring_.clear();
    history_ = enabled;
    update_state();
  }

  void pushCompileContext(std::string& md) {
    std::lock_guard<std::mutex> g(history_mu_);
    compile_context_.push_back(md);
  }
  void popCompileContext() {
    std::lock_guard<std::mutex> g(history_mu_);
    if (!compile_context_.empty()) compile_context_.pop_back();
  }
  void setUserMetadata(const std::string& metadata) {
    std::lock_guard<std::mutex> g(history_mu_);
    user_metadata_ = metadata;
  }
  std::string getUserMetadata() {
    std::lock_guard<std::mutex> g(history_mu_);
    return user_metadata_;
  }

  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) {
    std::lock_guard<std::mutex> g(history_mu_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) {
    std::lock_guard<std::mutex> g(history_mu_);
    drain_segments(nullptr, nullptr);
    trackers_.push_back(std::move(tracker));
    update_state();  // trackers hear every event, as PyTorch's do
  }

  // The memory cap of `device` in bytes (0: none), as set_per_process_memory_fraction set it:
  // what PyTorch's out-of-memory observers are told instead of the device's total.
  void set_allowed(int device, uint64_t bytes) {
    std::lock_guard<std::mutex> g(history_mu_);
    allowed_[device] = bytes;
  }

  // ---- the events ----
  // Out of memory (oom.h): the oom trace entry, the observers to call (outside the lock) and
  // the device's memory cap (0: none) in *allowed.
  std::vector<CCA::OutOfMemoryObserver> note_oom(int device, uint64_t free_b, size_t n,
                                                 cudaStream_t stream,
                                                 std::shared_ptr<c10::GatheredContext> ctx,
                                                 uint64_t* allowed) {
    std::lock_guard<std::mutex> g(history_mu_);
    auto a = allowed_.find(device);
    *allowed = a == allowed_.end() ? 0 : a->second;
    drain_segments(stream, ctx);  // the cache emptied before giving up
    if (active_.load()) push_trace(TraceEntry::OOM, device, free_b, n, stream, ctx);
    return oom_observers_;
  }

  // After an allocation while active(): its segment events, then the alloc entry. `ctx` was
  // gathered before the allocation, with no lock held.
  void note_alloc(int device, void* p, size_t n, cudaStream_t stream,
                  std::shared_ptr<c10::GatheredContext> ctx) {
    std::lock_guard<std::mutex> g(history_mu_);
    drain_segments(stream, ctx);
    auto it = live_.find(p);
    if (it != live_.end()) forget(it);  // a free this history did not hear (a restore)
    if (ctx) {
      filter_.add(p);
      tracked_.fetch_add(1, std::memory_order_relaxed);
    }
    push_trace(TraceEntry::ALLOC, device, (uint64_t)p, n, stream, ctx);
    // Switched off since the caller looked: only a context outlives recording.
    if (active_.load() || ctx) live_.emplace(p, Live{device, n, stream, std::move(ctx)});
  }

  // Before the free of `p` (wants_free): its free entries, the block's context dropped. Called
  // before the heap frees it, so that no allocation at its address can come first. The device
  // of the block in *device (-1 when nothing was recorded).
  void note_free(void* p, std::shared_ptr<c10::GatheredContext> ctx, int* device) {
    *device = -1;
    Live b;
    {
      std::lock_guard<std::mutex> g(history_mu_);
      auto it = live_.find(p);
      if (it != live_.end()) {
        b = it->second;
        forget(it);
        record_free(p, b, std::move(ctx));
        *device = b.device;
        return;
      }
      if (!active_.load()) return;  // a slot shared with a tracked block: nothing to drop
    }
    // Allocated before this history saw it: looked up by address, outside the lock.
    if (!block_request(p, &b.device, &b.size, &b.stream)) return;
    std::lock_guard<std::mutex> g(history_mu_);
    if (active_.load()) record_free(p, b, std::move(ctx));
    *device = b.device;
  }

  // A block of a MemPool with its own allocator (foreign_pools.h), a segment of its own: its
  // segment_alloc and alloc entries after the allocation (`alloc`), or its free entries and
  // segment_free before the free, while active; each carries the pool (NCCL's allocator hook
  // registers the segments of the pools it was given).
  void note_foreign(bool alloc, int device, void* p, size_t n, cudaStream_t stream,
                    MempoolId pool, std::shared_ptr<c10::GatheredContext> ctx) {
    std::lock_guard<std::mutex> g(history_mu_);
    if (!active_.load()) return;
    if (alloc) {
      push_trace(TraceEntry::SEGMENT_ALLOC, device, (uint64_t)p, n, stream, ctx, pool);
      push_trace(TraceEntry::ALLOC, device, (uint64_t)p, n, stream, ctx, pool);
    } else {
      push_trace(TraceEntry::FREE_REQUESTED, device, (uint64_t)p, n, stream, ctx, pool);
      push_trace(TraceEntry::FREE_COMPLETED, device, (uint64_t)p, n, stream, ctx, pool);
      push_trace(TraceEntry::SEGMENT_FREE, device, (uint64_t)p, n, stream, ctx, pool);
    }
  }

  // After a free, emptyCache, releasePool or anything else that may give segments back: their
  // segment_free entries (with `ctx`), when the log is on.
  void note_segments(std::shared_ptr<c10::GatheredContext> ctx) {
    if (!log_on_.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> g(history_mu_);
    drain_segments(nullptr, std::move(ctx));
  }

 private:
  struct Live {
    int device = 0;
    size_t size = 0;
    cudaStream_t stream = nullptr;
    std::shared_ptr<c10::GatheredContext> ctx;
  };

  // Under history_mu_.
  void forget(std::unordered_map<void*, Live>::iterator it) {
    if (it->second.ctx) {
      filter_.remove(it->first);
      tracked_.fetch_sub(1, std::memory_order_relaxed);
    }
    live_.erase(it);
  }

  // Under history_mu_: free_requested and free_completed of block `b` at `p`.
  void record_free(void* p, const Live& b, std::shared_ptr<c10::GatheredContext> ctx) {
    if (!active_.load()) return;
    push_trace(TraceEntry::FREE_REQUESTED, b.device, (uint64_t)p, b.size, b.stream, ctx);
    push_trace(TraceEntry::FREE_COMPLETED, b.device, (uint64_t)p, b.size, b.stream, ctx);
  }

  // Under history_mu_: takes every logged segment event, sets or drops segment contexts, and
  // records the entries while active (a new segment's context is `ctx`, the allocation's).
  void drain_segments(cudaStream_t stream, std::shared_ptr<c10::GatheredContext> ctx) {
    if (!log_on_.load(std::memory_order_relaxed)) return;
    SymmSegmentEvent ev[64];
    for (;;) {
      size_t n = 0;
      if (api.segment_events(-1, ev, 64, &n) != kSuccess) return;
      for (size_t i = 0; i < n; ++i) segment_event(ev[i], stream, ctx);
      if (n < 64) break;
    }
    update_state();
  }

  // Under history_mu_. A segment that grew in place goes back as PyTorch's expandable segments
  // do: segment_unmap for each range mapped after it, then segment_free of what
  // segment_alloc named, so that every range a tracker registered is deregistered as such.
  void segment_event(const SymmSegmentEvent& e, cudaStream_t stream,
                     const std::shared_ptr<c10::GatheredContext>& ctx) {
    MempoolId pool{e.pool_first, e.pool_second};
    bool active = active_.load();
    switch (e.kind) {
      case kSegmentMade:
        // Set or cleared: a new segment never inherits the frames of one given back at its
        // address.
        if (ctx)
          segment_ctx_[e.address] = ctx;
        else
          segment_ctx_.erase(e.address);
        grown_.erase(e.address);
        if (active)
          push_trace(TraceEntry::SEGMENT_ALLOC, e.device, e.address, e.size, stream, ctx, pool);
        break;
      case kSegmentMapped:
        grown_[e.segment_address].push_back({e.address, e.size});
        if (active)
          push_trace(TraceEntry::SEGMENT_MAP, e.device, e.address, e.size, stream, ctx, pool);
        break;
      case kSegmentFreed: {
        segment_ctx_.erase(e.address);
        uint64_t size = e.size;
        auto g = grown_.find(e.address);
        if (g != grown_.end()) {
          for (const auto& [addr, len] : g->second) {
            if (active)
              push_trace(TraceEntry::SEGMENT_UNMAP, e.device, addr, len, stream, ctx, pool);
            size -= std::min<uint64_t>(size, len);
          }
          grown_.erase(g);
        }
        if (active)
          push_trace(TraceEntry::SEGMENT_FREE, e.device, e.address, size, stream, ctx, pool);
        break;
      }
      default:
        // Events were dropped (the log was full): contexts of segments gone are dropped at the
        // next snapshot.
        break;
    }
  }

  // Under history_mu_: active while history is on or a tracker listens; the segment event log
  // on while active or a segment holds a context. Once inactive, live blocks without a context
  // are dropped (only contexts outlive recording).
  void update_state() {
    bool active = history_ || !trackers_.empty();
    if (active_.load() && !active) {
      for (auto it = live_.begin(); it != live_.end();)
        it = it->second.ctx ? std::next(it) : live_.erase(it);
    }
    active_.store(active);
    bool log = active || !segment_ctx_.empty();
    if (log != log_on_.load()) {
      // A log switched off is drained first (its events change contexts); on, it starts empty.
      if (!log) drain_off();
      api.segment_log(log ? 1 : 0);
      log_on_.store(log);
      if (log) discard_events();
      if (!log) grown_.clear();
    }
  }

  void drain_off() {
    SymmSegmentEvent ev[64];
    size_t n = 0;
    do {
      if (api.segment_events(-1, ev, 64, &n) != kSuccess) return;
      for (size_t i = 0; i < n; ++i)
        if (ev[i].kind == kSegmentFreed || ev[i].kind == kSegmentMade) {
          segment_ctx_.erase(ev[i].address);
          grown_.erase(ev[i].address);
        }
    } while (n == 64);
  }

  void discard_events() {
    SymmSegmentEvent ev[64];
    size_t n = 0;
    do {
      if (api.segment_events(-1, ev, 64, &n) != kSuccess) return;
    } while (n == 64);
  }

  // Under history_mu_.
  void push_trace(TraceEntry::Action action, int device, uint64_t addr, size_t size,
                  cudaStream_t stream, std::shared_ptr<c10::GatheredContext> ctx,
                  MempoolId pool = {0, 0}) {
    static const char* names[] = {"alloc",         "free_requested", "free_completed",
                                  "segment_alloc", "segment_free",   "segment_map",
                                  "segment_unmap", "snapshot",       "oom"};
    if ((size_t)action < sizeof names / sizeof *names && skip_.count(names[action])) return;
    // As PyTorch's record_trace: an entry carries frames only when contexts are recorded at
    // allocations or more (context="state" keeps them with live blocks and segments only).
    if (when_.load() < (int)CCA::RecordContext::ALLOC) ctx = nullptr;
    TraceEntry te(action, (c10::DeviceIndex)device, addr, size, (TraceStream)stream, pool,
                  c10::getApproximateTime(), std::move(ctx),
                  // PyTorch's allocator writes "N/A" outside a compiled region (the
                  // snapshot's readers, test_memory_compile_regions among them, skip it).
                  compile_context_.empty() ? std::string("N/A") : compile_context_.back(),
                  user_metadata_);
    for (const auto& t : trackers_) t(te);
    if (!history_) return;
    ring_.push_back(std::move(te));
    while (ring_.size() > max_entries_) ring_.pop_front();
  }

  std::atomic<bool> active_{false};
  std::atomic<bool> log_on_{false};
  std::atomic<int64_t> tracked_{0};
  AddressFilter filter_;
  std::atomic<CCA::CreateContextFn> recorder_{nullptr};
  std::atomic<int> when_{(int)CCA::RecordContext::NEVER};
  std::mutex history_mu_;
  size_t max_entries_ = 1;
  std::set<std::string> skip_;
  std::deque<TraceEntry> ring_;
  std::unordered_map<void*, Live> live_;
  std::map<uint64_t, std::shared_ptr<c10::GatheredContext>> segment_ctx_;
  // The ranges mapped after each segment that grew in place while the log was on.
  std::map<uint64_t, std::vector<std::pair<uint64_t, uint64_t>>> grown_;
  std::map<int, uint64_t> allowed_;
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;
  std::vector<CCA::AllocatorTraceTracker> trackers_;
  bool history_ = false;
  std::vector<std::string> compile_context_;
  std::string user_metadata_;
  c10::ApproximateClockToUnixTimeConverter clock_;
};

}  // namespace
}  // namespace symm_torch
