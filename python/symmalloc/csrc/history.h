// symmalloc's C++ allocator for PyTorch: what PyTorch's allocator records beside its heap.
// Included by torch_allocator.cpp only.
//
// Owns: the memory history (torch.cuda.memory._record_memory_history: the trace ring, the
// context of each live block and segment, the reserved bytes note_alloc last saw per device),
// the allocator trace trackers and out-of-memory observers, the compile context and user
// metadata each trace entry carries, and the snapshot (torch.cuda.memory._snapshot) assembled
// from the heap's blocks and these.
//
// Invariants:
// - Everything here but `recording_` is read and written under `history_mu_` only.
// - `recording_` is true while history is recorded, a tracker is attached, or a live block or
//   segment still holds a context recorded earlier (as PyTorch's, a block keeps its context
//   until it is freed, history on or off); the allocation and free paths read it with one
//   relaxed atomic load and call in here only when it is.
// - Switching history off empties the trace ring only (PyTorch's `recordHistory`).
// - Nothing here places memory: it reads the heap's blocks and statistics, never changes them.
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

class History {
 public:
  bool recording() const { return recording_.load(std::memory_order_relaxed); }

  // ---- snapshots and history (the allocator's methods of the same names) ----
  CCA::SnapshotInfo snapshot(int device_count, MempoolId mempool_id, bool include_traces) {
    CCA::SnapshotInfo out;
    bool one_pool = mempool_id.first != 0 || mempool_id.second != 0;
    std::lock_guard<std::mutex> g(history_mu_);
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
          auto sc = segment_ctx_.find(b.segment_address);
          if (sc != segment_ctx_.end()) seg->context_when_allocated = sc->second;
        }
        BlockInfo bi;
        bi.size = b.size;
        bi.requested_size = b.requested;
        bi.allocated = b.state == kBlockLive;
        bi.active = bi.allocated;
        auto c = contexts_.find((void*)b.address);
        if (bi.allocated && c != contexts_.end()) bi.context_when_allocated = c->second;
        if (bi.allocated) {
          seg->allocated_size += b.size;
          seg->active_size += b.size;
          seg->requested_size += b.requested;
        }
        seg->blocks.push_back(std::move(bi));
      }
      return false;
    });
    if (!one_pool) {
      // Entries of segments that are gone (given back outside emptyCache) go with them.
      std::set<uint64_t> present;
      for (const auto& s : out.segments) present.insert(s.address);
      for (auto it = segment_ctx_.begin(); it != segment_ctx_.end();)
        it = present.count(it->first) ? std::next(it) : segment_ctx_.erase(it);
      update_recording();
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
           std::to_string(recording_.load()) + ", when " + std::to_string((int)when_) +
           ", recorder " + std::to_string(recorder_ != nullptr) + ", ring " +
           std::to_string(ring_.size()) + " of " + std::to_string(max_entries_) +
           " (by device " + devices + ")" +
           ", skip [" + skip + "], trackers " + std::to_string(trackers_.size()) +
           ", contexts " + std::to_string(contexts_.size()) + ", segment contexts " +
           std::to_string(segment_ctx_.size());
  }

  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CCA::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) {
    std::lock_guard<std::mutex> g(history_mu_);
    // As PyTorch's allocator: switching off (or clearHistory) empties the trace ring; the
    // contexts of live blocks and segments stay with them until they are freed (CUDA-graph
    // trees switch history off after a capture, then name a leaked block by its frames).
    recorder_ = enabled ? context_recorder : nullptr;
    max_entries_ = std::max<size_t>(alloc_trace_max_entries, 1);
    when_ = enabled ? when : CCA::RecordContext::NEVER;
    skip_.clear();
    for (const auto& a : skip_actions) skip_.insert(a);
    if (clearHistory || !enabled) ring_.clear();
    history_ = enabled;
    update_recording();
    // Segments made or given back while nothing was recorded must not hide the next one:
    // note_alloc names a segment_alloc by the growth of the reserved bytes since this.
    refresh_reserved();
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
    trackers_.push_back(std::move(tracker));
    update_recording();  // trackers hear every event, as PyTorch's do
  }

  // ---- the events: note_alloc, note_free and note_segments_freed only while recording() ----
  // Out of memory (oom.h): the oom trace entry, and the observers to call (outside the lock).
  std::vector<CCA::OutOfMemoryObserver> note_oom(int device, uint64_t free_b, size_t n,
                                                 cudaStream_t stream) {
    std::vector<CCA::OutOfMemoryObserver> observers;
    std::lock_guard<std::mutex> g(history_mu_);
    observers = oom_observers_;
    if (history_ || !trackers_.empty()) push_trace(TraceEntry::OOM, device, free_b, n, stream, nullptr);
    return observers;
  }

  void note_alloc(int device, void* p, size_t n, cudaStream_t stream) {
    // Segment events: the heap's reserved bytes moved under this allocation.
    SymmDeviceStats s{};
    bool have = api.device_stats(device, &s, sizeof s) == kSuccess;
    std::lock_guard<std::mutex> g(history_mu_);
    auto ctx = gather(CCA::RecordContext::STATE);
    if (ctx)
      contexts_[p] = ctx;
    else
      contexts_.erase(p);
    if (have) {
      int64_t reserved = s.reserved_bytes[0].current;
      if (reserved > last_reserved_[device]) {
        uint64_t seg = (uint64_t)p;
        uint64_t size = (uint64_t)(reserved - last_reserved_[device]);
        for (const auto& b : list_blocks(device, nullptr))
          if ((uint64_t)p >= b.segment_address && (uint64_t)p < b.segment_address + b.segment_size) {
            seg = b.segment_address;
            break;
          }
        // Set or cleared: a segment given back outside emptyCache (the heap's trim before it
        // grows, a released pool, caching off) leaves its entry, and a new segment at the same
        // address must not inherit those frames.
        if (ctx)
          segment_ctx_[seg] = ctx;
        else
          segment_ctx_.erase(seg);
        push_trace(TraceEntry::SEGMENT_ALLOC, device, seg, size, stream, ctx);
      }
      last_reserved_[device] = reserved;
    }
    push_trace(TraceEntry::ALLOC, device, (uint64_t)p, n, stream, ctx);
    update_recording();
  }

  void note_free(void* p, int device, size_t size) {
    std::lock_guard<std::mutex> g(history_mu_);
    contexts_.erase(p);
    auto ctx = gather(CCA::RecordContext::ALL);
    push_trace(TraceEntry::FREE_REQUESTED, device, (uint64_t)p, size, nullptr, ctx);
    push_trace(TraceEntry::FREE_COMPLETED, device, (uint64_t)p, size, nullptr, ctx);
    update_recording();
  }

  // emptyCache: a segment_free for each segment of `before` (segments_now) not in `after`.
  void note_segments_freed(const std::map<std::pair<int, uint64_t>, uint64_t>& before,
                           const std::map<std::pair<int, uint64_t>, uint64_t>& after) {
    std::lock_guard<std::mutex> g(history_mu_);
    auto ctx = gather(CCA::RecordContext::ALL);
    for (const auto& [key, size] : before) {
      if (after.count(key)) continue;
      segment_ctx_.erase(key.second);
      push_trace(TraceEntry::SEGMENT_FREE, key.first, key.second, size, nullptr, ctx);
    }
    update_recording();
  }

  // After emptyCache gave segments back, recorded or not: refresh_reserved under the lock.
  void reserved_changed() {
    std::lock_guard<std::mutex> g(history_mu_);
    refresh_reserved();
  }

 private:
  // Under history_mu_: the reserved bytes now of every device note_alloc has seen (the base
  // it compares with; a device never seen has 0 and is not touched, so no heap is made here).
  void refresh_reserved() {
    for (auto& [d, last] : last_reserved_) {
      SymmDeviceStats s{};
      if (api.device_stats(d, &s, sizeof s) == kSuccess) last = s.reserved_bytes[0].current;
    }
  }

  // Under history_mu_: the allocation paths call note_* while history is on, a tracker
  // listens, or a live block or segment still holds a context (its free must drop it).
  void update_recording() {
    recording_.store(history_ || !trackers_.empty() || !contexts_.empty() || !segment_ctx_.empty());
  }

  // Under history_mu_.
  void push_trace(TraceEntry::Action action, int device, uint64_t addr, size_t size,
                  cudaStream_t stream, std::shared_ptr<c10::GatheredContext> ctx) {
    static const char* names[] = {"alloc",         "free_requested", "free_completed",
                                  "segment_alloc", "segment_free",   "segment_map",
                                  "segment_unmap", "snapshot",       "oom"};
    if ((size_t)action < sizeof names / sizeof *names && skip_.count(names[action])) return;
    // As PyTorch's record_trace: an entry carries frames only when contexts are recorded at
    // allocations or more (context="state" keeps them with live blocks and segments only).
    if (when_ < CCA::RecordContext::ALLOC) ctx = nullptr;
    TraceEntry te(action, (c10::DeviceIndex)device, addr, size, (TraceStream)stream, {0, 0},
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

  std::shared_ptr<c10::GatheredContext> gather(CCA::RecordContext at_least) {
    if (!recorder_ || when_ < at_least) return nullptr;
    return recorder_();
  }

  std::atomic<bool> recording_{false};
  std::mutex history_mu_;
  CCA::CreateContextFn recorder_ = nullptr;
  CCA::RecordContext when_ = CCA::RecordContext::NEVER;
  size_t max_entries_ = 1;
  std::set<std::string> skip_;
  std::deque<TraceEntry> ring_;
  std::unordered_map<void*, std::shared_ptr<c10::GatheredContext>> contexts_;
  std::map<uint64_t, std::shared_ptr<c10::GatheredContext>> segment_ctx_;
  std::map<int, int64_t> last_reserved_;
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;
  std::vector<CCA::AllocatorTraceTracker> trackers_;
  bool history_ = false;
  std::vector<std::string> compile_context_;
  std::string user_metadata_;
  c10::ApproximateClockToUnixTimeConverter clock_;
};

// (device, segment address) -> size of every segment now.
inline std::map<std::pair<int, uint64_t>, uint64_t> segments_now(int device_count) {
  std::map<std::pair<int, uint64_t>, uint64_t> out;
  for_each_heap(device_count, nullptr, [&](int d, const std::vector<SymmBlock>& blocks) {
    for (const auto& b : blocks) out[{d, b.segment_address}] = b.segment_size;
    return false;
  });
  return out;
}

}  // namespace
}  // namespace symm_torch
