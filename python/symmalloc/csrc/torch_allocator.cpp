// symmalloc as PyTorch's CUDA allocator: every virtual method of
// c10::cuda::CUDACachingAllocator::CUDAAllocator (torch 2.11), over libsymmalloc's C ABI.
//
// Owns: the allocator object that `symm_torch_install` hands to PyTorch
// (torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator), the table of libsymmalloc's
// functions it calls (loaded once with dlopen from the path the Python package gives), and
// what PyTorch's allocator keeps beside its heap: the out-of-memory observers and trace
// trackers, the memory fraction per device, and, while history is recorded, the trace ring and
// the allocation contexts.
//
// Invariants:
// - A DataPtr is (ptr, ctx = ptr, raw_deleter_fn, device), as PyTorch's own allocator makes
//   them: CUDA-graph trees compare deleters with raw_deleter() and swap them; the deleter frees
//   by address alone (symm_free_block: the block's own size and allocation stream).
// - The allocation path holds no lock of this file and calls no Python: one call into
//   libsymmalloc each way. History (a mutex, a map of contexts) is touched only while recorded.
// - No NULL ever reaches PyTorch: a failed allocation throws c10::OutOfMemoryError (out of
//   memory, after libsymmalloc emptied its cache and retried) or c10::Error (anything else),
//   and changes no existing allocation.
// - Placement never depends on which of these methods was called when: reads (statistics,
//   snapshots, checks) change nothing in the heap but cacheInfo, which merges the default
//   pool's parked large blocks as a large request would.

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "stream_uses.h"
#include "uncached.h"

namespace {

using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::Stat;
using c10::CachingDeviceAllocator::TraceEntry;
namespace CCA = c10::cuda::CUDACachingAllocator;
using MempoolId = c10::MempoolId_t;

// ---- libsymmalloc's C ABI (include/symmalloc.h), the parts this file calls ----
constexpr int kSuccess = 0;
constexpr int kOutOfMemory = 2;

struct SymmStat {
  int64_t current, peak, allocated, freed;
};
struct SymmDeviceStats {
  SymmStat allocation[3], segment[3], active[3], inactive_split[3], allocated_bytes[3],
      reserved_bytes[3], active_bytes[3], inactive_split_bytes[3], requested_bytes[3];
  int64_t num_alloc_retries, num_ooms;
  SymmStat oversize_allocations, oversize_segments;
  int64_t num_sync_all_streams, num_device_alloc, num_device_free, max_split_size;
};
static_assert(sizeof(SymmDeviceStats) == 976, "symm_device_stats_t v1");

struct SymmBlock {
  uint64_t address, size, requested, segment_address, segment_size, pool_first, pool_second,
      stream;
  uint32_t state, is_large;
};
constexpr uint32_t kBlockLive = 1;

using FilterFn = int (*)(void*, cudaStream_t);
using DropFn = void (*)(void*);

struct Api {
  int (*malloc_checked)(size_t, int, cudaStream_t, void**);
  int (*free_block)(void*);
  void (*record_stream)(void*, cudaStream_t);
  void (*empty_cache)();
  int (*device_stats)(int, SymmDeviceStats*, size_t);
  int (*reset_peak)(int);
  int (*reset_accumulated)(int);
  int (*set_memory_limit)(int, uint64_t);
  int (*cache_info)(int, uint64_t*);
  int (*heap_blocks)(int, int, uint64_t, uint64_t, SymmBlock*, size_t, size_t*);
  int (*pool_hold)(int, uint64_t, uint64_t);
  int (*pool_uses)(int, uint64_t, uint64_t, uint64_t*);
  int (*pool_restore)(int, uint64_t, uint64_t, const SymmBlock*, size_t);
  int (*begin_pool_filtered)(int, uint64_t, uint64_t, FilterFn, void*, DropFn);
  void (*end_pool)(int, uint64_t, uint64_t);
  void (*release_pool)(int, uint64_t, uint64_t);
  const char* (*last_error)();
};

Api api;

std::string last_error() {
  const char* e = api.last_error();
  return e ? std::string(e) : std::string();
}

void check(int status, const char* what) {
  TORCH_CHECK(status == kSuccess, "symmalloc: ", what, " failed: ", last_error());
}

std::string bytes_str(uint64_t b) {
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

Stat to_stat(const SymmStat& s) {
  Stat out;
  out.current = s.current;
  out.peak = s.peak;
  out.allocated = s.allocated;
  out.freed = s.freed;
  return out;
}

void copy_array(c10::CachingAllocator::StatArray& dst, const SymmStat (&src)[3]) {
  for (size_t i = 0; i < 3; ++i) dst[i] = to_stat(src[i]);
}

std::vector<SymmBlock> list_blocks(int device, const MempoolId* pool) {
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

// The raw deleter of every DataPtr this allocator makes.
void raw_deleter_fn(void* ptr);

// A checkpoint of one pool (CUDA-graph trees): its live blocks.
struct SymmCheckpoint final : CCA::AllocatorState {
  c10::DeviceIndex device;
  MempoolId pool;
  std::vector<SymmBlock> blocks;
};

class SymmAllocator final : public CCA::CUDAAllocator {
 public:
  // ---- allocation ----
  c10::DataPtr allocate(size_t n) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void* p = malloc_on(device, n, stream);
    return {p, p, &raw_deleter_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &raw_deleter_fn; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void* raw_alloc(size_t nbytes) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    return malloc_on(device, nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return malloc_on(c10::cuda::current_device(), nbytes, stream);
  }

  void raw_delete(void* ptr) override { free_ptr(ptr); }

  // Allocation on an explicit device (also the host tests' way in: no CUDA runtime needed).
  void* malloc_on(c10::DeviceIndex device, size_t n, cudaStream_t stream) {
    if (n == 0) return nullptr;
    if (foreign_routes_.load(std::memory_order_relaxed) > 0) {
      if (void* q = foreign_malloc(device, n, stream)) return q;
    }
    if (!caching_.load(std::memory_order_relaxed)) {
      cudaError_t cst = cudaSuccess;
      if (void* q = uncached_.malloc(device, n, &cst)) return q;
      if (cst == cudaErrorMemoryAllocation)
        out_of_memory(device, n, stream, "cudaMalloc with caching off: out of memory");
      // No CUDA device (the host backend): from the heap, given back at the free.
    }
    bool open = routes_open_.load(std::memory_order_relaxed) > 0;
    if (uses_.any_held() && !open) free_held(false);
    void* p = nullptr;
    int st = api.malloc_checked(n, device, stream, &p);
    if (st == kOutOfMemory && uses_.any_held() && !open) {
      free_held(true);  // blocks waiting on recorded streams, as PyTorch frees before an OOM
      st = api.malloc_checked(n, device, stream, &p);
    }
    if (st == kSuccess && p != nullptr) {
      if (recording_.load(std::memory_order_relaxed)) note_alloc(device, p, n, stream);
      if (c10::memoryProfilingEnabled()) report_to_profiler(device, p, (int64_t)n);
      return p;
    }
    std::string why = last_error();
    if (st == kOutOfMemory) out_of_memory(device, n, stream, why);
    TORCH_CHECK(false, "symmalloc: allocation of ", n, " bytes on device ", int(device),
                " failed: ", why);
  }

  void free_ptr(void* ptr) {
    if (ptr == nullptr) return;
    if (foreign_live_.load(std::memory_order_relaxed) > 0 && foreign_free(ptr)) return;
    if (uncached_.free(ptr)) return;
    std::vector<symm_torch::StreamUses::Use> uses;
    if (uses_.take(ptr, &uses)) {
      // Held until the recorded streams' work has run (stream_uses.h); while a pool route is
      // open, or without events, the heap orders the next reuse after those streams instead.
      if (routes_open_.load(std::memory_order_relaxed) == 0 && uses_.hold(ptr, uses)) return;
      for (const auto& u : uses) api.record_stream(ptr, u.stream);
    }
    free_now(ptr);
  }

  // The held blocks whose recorded streams are done (all of them, waiting, with `wait`).
  void free_held(bool wait) {
    for (void* p : uses_.ready(wait)) free_now(p);
  }

  void free_now(void* ptr) {
    bool profiling = c10::memoryProfilingEnabled();
    size_t size = 0;
    int device = 0;
    if (recording_.load(std::memory_order_relaxed) || profiling) find_live(ptr, &device, &size);
    if (recording_.load(std::memory_order_relaxed)) note_free(ptr, device, size);
    int st = api.free_block(ptr);
    if (st != kSuccess) {
      // A deleter cannot throw (it runs in destructors): say it, never abort.
      TORCH_WARN("symmalloc: free of ", ptr, " failed: ", last_error());
      return;
    }
    if (profiling) report_to_profiler(device, ptr, -(int64_t)size);
    if (!caching_.load(std::memory_order_relaxed)) api.empty_cache();
  }

  // ---- setup ----
  void init(int device_count) override {
    device_count_ = device_count;
    fraction_.assign(std::max(device_count, 1), 1.0);
    initialized_ = true;
  }
  bool initialized() override { return initialized_; }

  double getMemoryFraction(c10::DeviceIndex device) override {
    check_device(device, "getMemoryFraction");
    return fraction_[device];
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction >= 0 && fraction <= 1, "symmalloc: set_per_process_memory_fraction(",
                fraction, "): expected a fraction in [0, 1]");
    check_device(device, "setMemoryFraction");
    size_t free_b = 0, total = 0;
    {
      c10::cuda::CUDAGuard g(device);
      C10_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    }
    set_limit(device, fraction, total);
  }

  // The memory cap as a fraction of `total` bytes (host tests give the total themselves).
  void set_limit(c10::DeviceIndex device, double fraction, size_t total) {
    uint64_t limit = fraction >= 1.0 ? 0 : (uint64_t)(fraction * (double)total);
    if (fraction < 1.0 && limit == 0) limit = 1;  // 0 would lift the cap
    check(api.set_memory_limit(device, limit), "set_per_process_memory_fraction");
    if ((size_t)device >= fraction_.size()) fraction_.resize(device + 1, 1.0);
    fraction_[device] = fraction;
  }

  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};  // symmalloc's segments are not PyTorch's expandable segments
  }

  void emptyCache(MempoolId /*mempool_id*/) override {
    // symmalloc gives back the free segments of the default pool and of released pools; a
    // live pool keeps its own, as PyTorch does.
    bool tracing = recording_.load(std::memory_order_relaxed);
    std::map<std::pair<int, uint64_t>, uint64_t> before;
    if (tracing) before = segments_now();
    if (uses_.any_held() && routes_open_.load(std::memory_order_relaxed) == 0) free_held(true);
    api.empty_cache();
    std::string e = last_error();
    TORCH_CHECK(e.empty(), "symmalloc: empty_cache failed: ", e);
    if (tracing) {
      auto after = segments_now();
      std::lock_guard<std::mutex> g(history_mu_);
      auto ctx = gather(CCA::RecordContext::ALL);
      for (const auto& [key, size] : before) {
        if (after.count(key)) continue;
        segment_ctx_.erase(key.second);
        push_trace(TraceEntry::SEGMENT_FREE, key.first, key.second, size, nullptr, ctx);
      }
    }
    std::lock_guard<std::mutex> g(history_mu_);
    refresh_reserved();
  }

  // Off: allocations come from cudaMalloc and go back with cudaFree (uncached.h), as with
  // PyTorch's allocator; on the host backend (no CUDA) from the heap, given back at the free.
  void enable(bool value) override { caching_.store(value); }
  bool isEnabled() const override { return caching_.load(); }

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    uint64_t largest = 0;
    check(api.cache_info(device, &largest), "cacheInfo");
    *largestBlock = largest;
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    int device = device_of(ptr);
    for (const auto& b : list_blocks(device, nullptr)) {
      if ((uint64_t)ptr >= b.segment_address && (uint64_t)ptr < b.segment_address + b.segment_size) {
        if (size) *size = b.segment_size;
        return (void*)b.segment_address;
      }
    }
    TORCH_CHECK(false, "symmalloc: getBaseAllocation(", ptr, "): not a symmalloc block");
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (!ptr.get() || ptr.get_deleter() != &raw_deleter_fn) return;
    if (routes_open_.load(std::memory_order_relaxed) == 0) {
      uses_.record(ptr.get(), ptr.device().index(), stream.stream());
      return;
    }
    api.record_stream(ptr.get(), stream.stream());
    std::string e = last_error();
    TORCH_CHECK(e.empty(), "symmalloc: record_stream failed: ", e);
  }

  // ---- statistics ----
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    SymmDeviceStats s{};
    check(api.device_stats(device, &s, sizeof s), "getDeviceStats");
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
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check(api.reset_accumulated(device), "resetAccumulatedStats");
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    check(api.reset_peak(device), "resetPeakStats");
  }

  // ---- snapshots and history ----
  CCA::SnapshotInfo snapshot(MempoolId mempool_id, bool include_traces) override {
    CCA::SnapshotInfo out;
    bool one_pool = mempool_id.first != 0 || mempool_id.second != 0;
    std::lock_guard<std::mutex> g(history_mu_);
    for (int d = 0; d < std::max(device_count_, 1); ++d) {
      std::vector<SymmBlock> blocks;
      try {
        blocks = list_blocks(d, one_pool ? &mempool_id : nullptr);
      } catch (const c10::Error&) {
        continue;  // a device whose heap cannot be read (none made there, no such device)
      }
      CCA::SegmentInfo* seg = nullptr;
      for (const auto& b : blocks) {
        if (!seg || seg->address != b.segment_address) {
          out.segments.emplace_back();
          seg = &out.segments.back();
          seg->device = (c10::DeviceIndex)d;
          seg->address = b.segment_address;
          seg->total_size = b.segment_size;
          seg->stream = (void*)(uintptr_t)(b.stream == UINT64_MAX ? 0 : b.stream);
          seg->is_large = b.is_large != 0;
          seg->is_expandable = false;
          seg->owner_private_pool_id = {b.pool_first, b.pool_second};
          auto sc = segment_ctx_.find(b.segment_address);
          if (sc != segment_ctx_.end()) seg->context_when_allocated = sc->second;
        }
        c10::CachingDeviceAllocator::BlockInfo bi;
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
    }
    auto to_us = clock_.makeConverter();
    if (include_traces) {
      out.device_traces.resize(std::max(device_count_, 1));
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

  bool isHistoryEnabled() override {
    std::lock_guard<std::mutex> g(history_mu_);
    return history_;
  }

  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CCA::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    std::lock_guard<std::mutex> g(history_mu_);
    recorder_ = context_recorder;
    max_entries_ = std::max<size_t>(alloc_trace_max_entries, 1);
    when_ = when;
    skip_.clear();
    for (const auto& a : skip_actions) skip_.insert(a);
    if (clearHistory) {
      ring_.clear();
      contexts_.clear();
      segment_ctx_.clear();
    }
    if (!enabled) {
      ring_.clear();
      contexts_.clear();
      segment_ctx_.clear();
    }
    history_ = enabled;
    recording_.store(enabled || !trackers_.empty());
    // Segments made or given back while nothing was recorded must not hide the next one:
    // note_alloc names a segment_alloc by the growth of the reserved bytes since this.
    refresh_reserved();
  }

  // Under history_mu_: the reserved bytes now of every device note_alloc has seen (the base
  // it compares with; a device never seen has 0 and is not touched, so no heap is made here).
  void refresh_reserved() {
    for (auto& [d, last] : last_reserved_) {
      SymmDeviceStats s{};
      if (api.device_stats(d, &s, sizeof s) == kSuccess) last = s.reserved_bytes[0].current;
    }
  }

  void pushCompileContext(std::string& md) override {
    std::lock_guard<std::mutex> g(history_mu_);
    compile_context_.push_back(md);
  }
  void popCompileContext() override {
    std::lock_guard<std::mutex> g(history_mu_);
    if (!compile_context_.empty()) compile_context_.pop_back();
  }
  void setUserMetadata(const std::string& metadata) override {
    std::lock_guard<std::mutex> g(history_mu_);
    user_metadata_ = metadata;
  }
  std::string getUserMetadata() override {
    std::lock_guard<std::mutex> g(history_mu_);
    return user_metadata_;
  }

  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(history_mu_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> g(history_mu_);
    trackers_.push_back(std::move(tracker));
    recording_.store(true);  // trackers hear every event, as PyTorch's do
  }

  // ---- pools and graph capture ----
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId id,
                           std::function<bool(cudaStream_t)> filter) override {
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      auto it = foreign_pools_.find(id);
      if (it != foreign_pools_.end()) {
        it->second.uses++;
        routes_.push_back({device, id, std::move(filter), it->second.allocator});
        foreign_routes_.fetch_add(1);
        routes_open_.fetch_add(1);
        return;
      }
    }
    auto* ctx = new std::function<bool(cudaStream_t)>(std::move(filter));
    int st = api.begin_pool_filtered(
        device, id.first, id.second,
        [](void* c, cudaStream_t s) -> int {
          return (*static_cast<std::function<bool(cudaStream_t)>*>(c))(s) ? 1 : 0;
        },
        ctx, [](void* c) { delete static_cast<std::function<bool(cudaStream_t)>*>(c); });
    check(st, "beginAllocateToPool");
    routes_open_.fetch_add(1);
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId id) override {
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {
        if (it->device == device && it->pool == id) {
          routes_.erase(std::next(it).base());
          foreign_routes_.fetch_sub(1);
          routes_open_.fetch_sub(1);
          return;
        }
      }
    }
    api.end_pool(device, id.first, id.second);
    if (routes_open_.load() > 0) routes_open_.fetch_sub(1);
    std::string e = last_error();
    TORCH_CHECK(e.empty(), "symmalloc: endAllocateToPool failed: ", e);
  }

  void releasePool(c10::DeviceIndex device, MempoolId id) override {
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      auto it = foreign_pools_.find(id);
      if (it != foreign_pools_.end()) {
        if (--it->second.uses <= 0) foreign_pools_.erase(it);
        return;
      }
    }
    api.release_pool(device, id.first, id.second);
    std::string e = last_error();
    // Called from CUDAGraph::reset (a destructor): warn, never throw there.
    if (!e.empty()) TORCH_WARN("symmalloc: releasePool failed: ", e);
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId id) override {
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      auto it = foreign_pools_.find(id);
      if (it != foreign_pools_.end()) return it->second.uses;
    }
    uint64_t uses = 0;
    check(api.pool_uses(device, id.first, id.second, &uses), "getPoolUseCount");
    return (int)uses;
  }

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    // A MemPool in global mode: with no allocator of its own its blocks come from symmalloc's
    // heap, in a pool of its own; with one (a MemPool(allocator=...), NCCL's for buffer
    // registration, say) its blocks come from that allocator, as PyTorch's allocator does it.
    if (allocator && allocator.get() != this) {
      std::lock_guard<std::mutex> g(foreign_mu_);
      auto& fp = foreign_pools_[id];
      fp.allocator = std::move(allocator);
      fp.uses++;
      return;
    }
    check(api.pool_hold(device, id.first, id.second), "createOrIncrefPool");
  }

  void setUseOnOOM(c10::DeviceIndex device, MempoolId id, bool use_on_oom) override {
    (void)device;
    (void)id;
    TORCH_CHECK(!use_on_oom,
                "symmalloc: MemPool(use_on_oom=True) is not supported: symmalloc never lends "
                "a live pool's memory to other allocations (it would break the pool's symmetric "
                "placement); create the MemPool without use_on_oom");
  }

  void setNoSplit(c10::DeviceIndex device, MempoolId id) override {
    (void)device;
    (void)id;
    TORCH_CHECK(false, "symmalloc: MemPool(no_split=True) is not supported: symmalloc splits "
                       "its segments by design; create the MemPool without no_split");
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId id,
                                const std::unordered_set<void*>& expected) override {
    size_t live = 0;
    for (const auto& b : list_blocks(device, &id)) {
      if (b.state != kBlockLive) continue;
      ++live;
      if (!expected.count((void*)b.address)) return false;
    }
    return live == expected.size();
  }

  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId id) override {
    auto st = std::make_shared<SymmCheckpoint>();
    st->device = device;
    st->pool = id;
    for (const auto& b : list_blocks(device, &id))
      if (b.state == kBlockLive) st->blocks.push_back(b);
    return st;
  }

  CCA::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<CCA::AllocatorState> pps) override {
    auto* st = dynamic_cast<SymmCheckpoint*>(pps.get());
    TORCH_CHECK(st != nullptr, "symmalloc: setCheckpointPoolState: the state is not one "
                               "symmalloc's getCheckpointState made");
    TORCH_CHECK(st->device == device, "symmalloc: setCheckpointPoolState: checkpoint of device ",
                int(st->device), ", asked for device ", int(device));
    CCA::CheckpointDelta delta;
    for (const auto& b : list_blocks(device, &st->pool))
      if (b.state == kBlockLive) delta.ptrs_freed.push_back((void*)b.address);
    check(api.pool_restore(device, st->pool.first, st->pool.second, st->blocks.data(),
                           st->blocks.size()),
          "setCheckpointPoolState");
    for (const auto& b : st->blocks) {
      void* p = (void*)b.address;
      delta.dataptrs_allocd.emplace_back(p, p, &raw_deleter_fn,
                                         c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // ---- sharing across processes and devices ----
  CCA::ShareableHandle shareIpcHandle(void* ptr) override {
    TORCH_CHECK(false, "symmalloc: sharing a CUDA tensor with another process (",
                ptr, ") through torch.multiprocessing is not supported in symmalloc's "
                "global mode: its memory is mapped with cuMemMap, which CUDA IPC handles "
                "cannot export. Send the tensor's data through CPU memory, or between ranks "
                "use a symmalloc communicator (symmalloc.comm: peer tensors, put/signal)");
  }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    (void)handle;
    TORCH_CHECK(false, "symmalloc: opening a CUDA IPC handle from another process is not "
                       "supported in symmalloc's global mode; send the data through CPU "
                       "memory or a symmalloc communicator");
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard g(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::string name() override { return "symmalloc"; }

  // ---- the out-of-memory path ----
  [[noreturn]] void out_of_memory(c10::DeviceIndex device, size_t n, cudaStream_t stream,
                                  const std::string& why) {
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
      (void)cudaGetLastError();  // no device (host backend) or a broken context: say unknown
      free_b = total = 0;
    }
    SymmDeviceStats s{};
    (void)api.device_stats(device, &s, sizeof s);
    uint64_t allocated = s.allocated_bytes[0].current;
    uint64_t reserved = s.reserved_bytes[0].current;
    std::vector<CCA::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> g(history_mu_);
      observers = oom_observers_;
      if (history_ || !trackers_.empty()) push_trace(TraceEntry::OOM, device, free_b, n, stream, nullptr);
    }
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

  int device_count() const { return device_count_; }

 private:
  void check_device(c10::DeviceIndex device, const char* what) {
    TORCH_CHECK(device >= 0 && (size_t)device < fraction_.size(), "symmalloc: ", what,
                ": device ", int(device), " does not exist; expected 0..",
                (int)fraction_.size() - 1);
  }

  int device_of(void* ptr) {
    for (int d = 0; d < std::max(device_count_, 1); ++d) {
      try {
        for (const auto& b : list_blocks(d, nullptr))
          if ((uint64_t)ptr >= b.segment_address &&
              (uint64_t)ptr < b.segment_address + b.segment_size)
            return d;
      } catch (const c10::Error&) {
      }
    }
    return 0;
  }

  // Under history_mu_.
  void push_trace(TraceEntry::Action action, int device, uint64_t addr, size_t size,
                  cudaStream_t stream, std::shared_ptr<c10::GatheredContext> ctx) {
    static const char* names[] = {"alloc",         "free_requested", "free_completed",
                                  "segment_alloc", "segment_free",   "segment_map",
                                  "segment_unmap", "snapshot",       "oom"};
    if ((size_t)action < sizeof names / sizeof *names && skip_.count(names[action])) return;
    TraceEntry te(action, (c10::DeviceIndex)device, addr, size, (void*)stream, {0, 0},
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

  void note_alloc(int device, void* p, size_t n, cudaStream_t stream) {
    // Segment events: the heap's reserved bytes moved under this allocation.
    SymmDeviceStats s{};
    bool have = api.device_stats(device, &s, sizeof s) == kSuccess;
    std::lock_guard<std::mutex> g(history_mu_);
    auto ctx = gather(CCA::RecordContext::STATE);
    if (ctx) contexts_[p] = ctx;
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
        if (ctx) segment_ctx_[seg] = ctx;
        push_trace(TraceEntry::SEGMENT_ALLOC, device, seg, size, stream, ctx);
      }
      last_reserved_[device] = reserved;
    }
    push_trace(TraceEntry::ALLOC, device, (uint64_t)p, n, stream,
               when_ >= CCA::RecordContext::ALLOC ? ctx : nullptr);
  }

  // The device and request of the live block at `p` (0, 0 when not found).
  void find_live(void* p, int* device, size_t* size) {
    for (int d = 0; d < std::max(device_count_, 1); ++d) {
      try {
        for (const auto& b : list_blocks(d, nullptr))
          if (b.address == (uint64_t)p && b.state == kBlockLive) {
            *device = d;
            *size = b.requested;
            return;
          }
      } catch (const c10::Error&) {
      }
    }
  }

  // (device, segment address) -> size of every segment now.
  std::map<std::pair<int, uint64_t>, uint64_t> segments_now() {
    std::map<std::pair<int, uint64_t>, uint64_t> out;
    for (int d = 0; d < std::max(device_count_, 1); ++d) {
      try {
        for (const auto& b : list_blocks(d, nullptr)) out[{d, b.segment_address}] = b.segment_size;
      } catch (const c10::Error&) {
      }
    }
    return out;
  }

  void report_to_profiler(int device, void* p, int64_t delta) {
    SymmDeviceStats s{};
    if (api.device_stats(device, &s, sizeof s) != kSuccess) return;
    c10::reportMemoryUsageToProfiler(p, delta, (size_t)s.allocated_bytes[0].current,
                                     (size_t)s.reserved_bytes[0].current,
                                     c10::Device(c10::DeviceType::CUDA, (c10::DeviceIndex)device));
  }

  void note_free(void* p, int device, size_t size) {
    std::lock_guard<std::mutex> g(history_mu_);
    contexts_.erase(p);
    auto ctx = gather(CCA::RecordContext::ALL);
    push_trace(TraceEntry::FREE_REQUESTED, device, (uint64_t)p, size, nullptr, ctx);
    push_trace(TraceEntry::FREE_COMPLETED, device, (uint64_t)p, size, nullptr, ctx);
  }

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
  struct MempoolHash {
    size_t operator()(const MempoolId& id) const {
      return std::hash<uint64_t>()(id.first) * 31 + std::hash<uint64_t>()(id.second);
    }
  };

  void* foreign_malloc(c10::DeviceIndex device, size_t n, cudaStream_t stream) {
    std::shared_ptr<CCA::CUDAAllocator> alloc;
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      for (auto it = routes_.rbegin(); it != routes_.rend(); ++it)
        if (it->device == device && it->filter(stream)) {
          alloc = it->allocator;
          break;
        }
    }
    if (!alloc) return nullptr;
    c10::cuda::CUDAGuard guard(device);
    void* p = alloc->raw_alloc_with_stream(n, stream);
    TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr, "CUDA out of memory. Tried to allocate ",
                     bytes_str(n), " from the MemPool's own allocator (", alloc->name(), ")");
    std::lock_guard<std::mutex> g(foreign_mu_);
    foreign_ptrs_[p] = std::move(alloc);
    foreign_live_.fetch_add(1);
    return p;
  }

  bool foreign_free(void* p) {
    std::shared_ptr<CCA::CUDAAllocator> alloc;
    {
      std::lock_guard<std::mutex> g(foreign_mu_);
      auto it = foreign_ptrs_.find(p);
      if (it == foreign_ptrs_.end()) return false;
      alloc = std::move(it->second);
      foreign_ptrs_.erase(it);
      foreign_live_.fetch_sub(1);
    }
    alloc->raw_delete(p);
    return true;
  }

  std::mutex foreign_mu_;
  std::unordered_map<MempoolId, ForeignPool, MempoolHash> foreign_pools_;
  std::vector<ForeignRoute> routes_;
  std::unordered_map<void*, std::shared_ptr<CCA::CUDAAllocator>> foreign_ptrs_;
  std::atomic<int> foreign_routes_{0};
  std::atomic<int> foreign_live_{0};

  int device_count_ = 0;
  bool initialized_ = false;
  std::vector<double> fraction_ = std::vector<double>(64, 1.0);

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
  std::atomic<bool> caching_{true};
  symm_torch::Uncached uncached_;
  symm_torch::StreamUses uses_;
  // Pool routes open (graph captures and MemPool contexts): PyTorch's "captures underway".
  std::atomic<int> routes_open_{0};
  std::vector<std::string> compile_context_;
  std::string user_metadata_;
  c10::ApproximateClockToUnixTimeConverter clock_;
};

std::shared_ptr<SymmAllocator>& instance() {
  static std::shared_ptr<SymmAllocator> a;
  return a;
}

void raw_deleter_fn(void* ptr) { instance()->free_ptr(ptr); }

std::string load_api(const char* path) {
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
  SYMM_LOAD(last_error, "symm_last_error");
#undef SYMM_LOAD
  if (!missing.empty()) return std::string(path) + " lacks " + missing + " (an older library)";
  return "";
}

int fail(char* err, size_t len, const std::string& msg) {
  if (err && len) std::snprintf(err, len, "%s", msg.c_str());
  return 1;
}

int make(const char* library_path, char* err, size_t len) {
  if (instance()) return 0;
  if (!library_path) return fail(err, len, "library_path is NULL");
  std::string e = load_api(library_path);
  if (!e.empty()) return fail(err, len, e);
  instance() = std::make_shared<SymmAllocator>();
  return 0;
}

}  // namespace

// ---- the extension's own C entry points (called from python/symmalloc/_torch_ext.py) ----
extern "C" {

// The torch this file was built against: torch.__version__ as the build gave it
// (SYMM_TORCH_FULL_VERSION, with the CUDA flavour), else TORCH_VERSION.
#ifndef SYMM_TORCH_FULL_VERSION
#define SYMM_TORCH_FULL_VERSION TORCH_VERSION
#endif
const char* symm_torch_built_for() { return SYMM_TORCH_FULL_VERSION; }

// Makes the allocator over the library at `library_path` and installs it as PyTorch's CUDA
// allocator. 0 on success; otherwise 1 and a message in err (PyTorch's allocator already in
// use, a library without the calls this needs).
int symm_torch_install(const char* library_path, char* err, size_t len) {
  try {
    if (int r = make(library_path, err, len)) return r;
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(instance());
    // torch.accelerator's memory API reads c10::GetAllocator(kCUDA): the same object.
    c10::SetAllocator(c10::DeviceType::CUDA, instance().get(), /*priority=*/255);
    return 0;
  } catch (const std::exception& e) {
    return fail(err, len, e.what());
  }
}

// Whether symmalloc is the allocator PyTorch calls now.
int symm_torch_installed() {
  return instance() && CCA::get() == instance().get() ? 1 : 0;
}

// The host backend's checks (CI, no GPU): the allocator object's methods that take a device,
// run against libsymmalloc on host memory without installing it (no CUDA runtime is needed).
// Returns 0 when every check held, else 1 with the first failure in err.
int symm_torch_selftest(const char* library_path, int device, char* err, size_t len) {
  try {
    if (int r = make(library_path, err, len)) return r;
    auto& a = *instance();
    a.init(8);
#define EXPECT(cond, what) \
  if (!(cond)) return fail(err, len, std::string("selftest: ") + what)
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
    a.releasePool(device, pool);
    a.releasePool(device, pool);  // the begin's use

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
    return 0;
  } catch (const std::exception& e) {
    return fail(err, len, std::string("selftest: ") + e.what());
  }
}

}  // extern "C"
