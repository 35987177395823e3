// symmalloc as PyTorch's CUDA allocator: every virtual method of
// c10::cuda::CUDACachingAllocator::CUDAAllocator (torch 2.10 to 2.15: torch_compat.h), over
// libsymmalloc's C ABI.
//
// Owns: the allocator object that `symm_torch_install` hands to PyTorch
// (torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator), the memory fraction per device,
// and the extension's C entry points. The object ties together the headers beside this file,
// one job each, included here only (one translation unit): api.h (libsymmalloc's C ABI, its
// table loaded once with dlopen from the path the Python package gives), history.h (what
// PyTorch's allocator keeps beside its heap: the out-of-memory observers and trace trackers,
// and, while history is recorded, the trace ring and the allocation contexts), oom.h (the
// out-of-memory error), checkpoint.h (a pool's checkpoints, CUDA-graph trees), foreign_pools.h
// (MemPools with an allocator of their own), stream_uses.h (record_stream), uncached.h (caching
// off), profile.h (a build that times the allocation path) and selftest.h (the host backend's
// checks), pool_stats.h (each private pool's reserved bytes) and settings.h (settings changed at
// run time).
//
// Invariants:
// - A DataPtr is (ptr, ctx = ptr, raw_deleter_fn, device), as PyTorch's own allocator makes
//   them: CUDA-graph trees compare deleters with raw_deleter() and swap them; the deleter frees
//   by address alone (symm_free_block: the block's own size and allocation stream).
// - The allocation path holds no lock of these files and calls no Python: one call into
//   libsymmalloc each way. History (a mutex, a map of live blocks) is touched only while
//   recorded, or by the free of a block that still holds a recorded context (history.h); its
//   frames are gathered before any lock is taken.
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
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include "api.h"
#include "checkpoint.h"
#include "foreign_pools.h"
#include "history.h"
#include "ipc.h"
#include "oom.h"
#include "pool_stats.h"
#include "profile.h"
#include "selftest.h"
#include "settings.h"
#include "stream_uses.h"
#include "uncached.h"

namespace {

using namespace symm_torch;  // NOLINT: the parts above, as if written here

// The raw deleter of every DataPtr this allocator makes.
void raw_deleter_fn(void* ptr);

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
    if (conf_pending_.load(std::memory_order_relaxed) != 0) apply_conf_fraction(device);
    SYMM_PROF_ALLOC(p, n, stream);
    if (foreign_.routes() > 0) {
      if (void* q = foreign_.malloc(device, n, stream, hist_)) return q;
    }
    if (!caching_.load(std::memory_order_relaxed)) {
      cudaError_t cst = cudaSuccess;
      if (void* q = uncached_.malloc(device, n, &cst)) return q;
      if (cst == cudaErrorMemoryAllocation)
        out_of_memory(hist_, device, n, stream, "cudaMalloc with caching off: out of memory");
      // No CUDA device (the host backend): from the heap, given back at the free.
    }
    bool open = routes_open_.load(std::memory_order_relaxed) > 0;
    if (uses_.any_held() && !open) free_held(false);
    // Frames before any lock is taken (history.h): the recorder may take the GIL.
    bool recording = hist_.active();
    auto ctx = recording ? hist_.gather(CCA::RecordContext::STATE) : nullptr;
    void* p = nullptr;
    int st;
    {
      SYMM_PROF_INNER();
      st = api.malloc_checked(n, device, stream, &p);
    }
    if (st == kOutOfMemory && uses_.any_held() && !open) {
      free_held(true);  // blocks waiting on recorded streams, as PyTorch frees before an OOM
      st = api.malloc_checked(n, device, stream, &p);
    }
    if (st == kSuccess && p != nullptr) {
      SYMM_PROF_RESULT(p);
      if (recording) hist_.note_alloc(device, p, n, stream, std::move(ctx));
      if (c10::memoryProfilingEnabled()) report_to_profiler(device, p, (int64_t)n);
      return p;
    }
    std::string why = last_error();
    if (st == kOutOfMemory) out_of_memory(hist_, device, n, stream, why);
    TORCH_CHECK(false, "symmalloc: allocation of ", n, " bytes on device ", int(device),
                " failed: ", why);
  }

  void free_ptr(void* ptr) {
    if (ptr == nullptr) return;
    SYMM_PROF_FREE(ptr);
    if (foreign_.live() > 0 && foreign_.free(ptr, hist_)) return;
    if (uncached_.free(ptr)) return;
    std::vector<symm_torch::StreamUses::Use> uses;
    if (uses_.take(ptr, &uses)) {
      // Held until the recorded streams' work has run (stream_uses.h); while a pool route is
      // open, or without events, the heap orders the next reuse after those streams instead.
      if (routes_open_.load(std::memory_order_relaxed) == 0 && uses_.hold(ptr, uses)) return;
      for (const auto& u : uses) api.record_stream(ptr, u.stream);
    }
    SYMM_PROF_INNER();
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
    if (profiling) block_request(ptr, &device, &size);
    bool noted = hist_.wants_free(ptr);
    auto ctx = noted ? hist_.gather(CCA::RecordContext::ALL) : nullptr;  // before any lock
    if (noted) hist_.note_free(ptr, ctx, &device);
    int st = api.free_block(ptr);
    if (st != kSuccess) {
      // A deleter cannot throw (it runs in destructors): say it, never abort.
      TORCH_WARN("symmalloc: free of ", ptr, " failed: ", last_error());
      return;
    }
    if (profiling) report_to_profiler(device, ptr, -(int64_t)size);
    if (!caching_.load(std::memory_order_relaxed)) api.empty_cache();
    if (noted) hist_.note_segments(std::move(ctx));  // segments the free gave back
  }

  // ---- setup ----
  void init(int device_count) override {
    device_count_ = device_count;
    fraction_.assign(std::max(device_count, 1), 1.0);
    initialized_ = true;
    if (conf_fraction_.load() < 1.0) configure(conf_fraction_.load(), caching_.load());
  }

  // PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction and PYTORCH_NO_CUDA_MEMORY_CACHING
  // (install_global() parses them; symm_torch_configure). PyTorch caps each device at its
  // allocator's creation; here each device's cap is set at its first allocation (setting it
  // earlier would make a heap, and a CUDA context, on every visible device), from the
  // device's total memory as PyTorch takes it (cudaGetDeviceProperties). An explicit
  // set_per_process_memory_fraction on a device before that wins, as it does in PyTorch.
  void configure(double fraction, bool caching) {
    conf_fraction_.store(fraction);
    caching_.store(caching);
    if (!initialized_ || fraction >= 1.0) return;
    set_conf_fraction(fraction);
  }

  // per_process_memory_fraction set at run time (settings.h) or at install: each device's cap
  // becomes `fraction` of its memory at its next allocation (1 lifts it).
  void set_conf_fraction(double fraction) {
    conf_fraction_.store(fraction);
    if (!initialized_) return;  // init() applies it
    uint64_t all = device_count_ >= 64 ? ~0ull : (1ull << std::max(device_count_, 1)) - 1;
    for (auto& f : fraction_) f = fraction;
    conf_pending_.store(all);
  }

  void apply_conf_fraction(c10::DeviceIndex device) {
    uint64_t bit = device >= 0 && device < 64 ? 1ull << device : 0;
    if ((conf_pending_.fetch_and(~bit) & bit) == 0) return;
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess) {  // no CUDA device (the host backend): no total to take a share of
      (void)cudaGetLastError();
      TORCH_WARN_ONCE("symmalloc: per_process_memory_fraction ", conf_fraction_.load(),
                      " not applied on device ", int(device), ": ", cudaGetErrorString(e));
      return;
    }
    set_limit(device, conf_fraction_.load(), prop.totalGlobalMem);
  }
  double conf_fraction() const { return conf_fraction_.load(); }
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
    if (device >= 0 && device < 64) conf_pending_.fetch_and(~(1ull << device));
    hist_.set_allowed(device, limit);  // what the out-of-memory observers are told
    if ((size_t)device >= fraction_.size()) fraction_.resize(device + 1, 1.0);
    fraction_[device] = fraction;
  }

  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};  // symmalloc's segments are not PyTorch's expandable segments
  }

  void emptyCache(MempoolId mempool_id) override {
    // symmalloc gives back the free segments of the default pool and of released pools; a
    // live pool keeps its own, as PyTorch does. With a pool's id (torch 2.11's MemPool
    // destructor: releasePool, then emptyCache(id)) only that pool's cache is meant: its free
    // segments went back at its last releasePool (symm_release_pool), and the default pool's
    // cache stays (test_mempool_empty_cache: it emptied the whole cache, one H200, 2026-12-03).
    if (mempool_id.first != 0 || mempool_id.second != 0) return;
    auto ctx = hist_.active() ? hist_.gather(CCA::RecordContext::ALL) : nullptr;
    if (uses_.any_held() && routes_open_.load(std::memory_order_relaxed) == 0) free_held(true);
    api.empty_cache();
    std::string e = last_error();
    close_stale_exports();  // descriptors shared for chunks now given back (ipc.h)
    hist_.note_segments(std::move(ctx));  // segment_free of each segment given back
    TORCH_CHECK(e.empty(), "symmalloc: empty_cache failed: ", e);
  }

  // Off: allocations come from cudaMalloc and go back with cudaFree (uncached.h), as with
  // PyTorch's allocator; on the host backend (no CUDA) from the heap, given back at the free.
  void enable(bool value) override { caching_.store(value); }
  bool isEnabled() const override { return caching_.load(); }

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    cache_info(device, largestBlock);  // as PyTorch's allocator computes it (oom.h)
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    int device = device_of(device_count_, ptr);
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
    DeviceStats out = to_device_stats(s);
#if SYMM_TORCH_HAS_PRIVATE_POOL_STATS
    for (auto& [id, st] : pool_stats_.read(device)) out.reserved_bytes_by_private_pools[id] = st;
#endif
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check(api.reset_accumulated(device), "resetAccumulatedStats");
    pool_stats_.reset_accumulated(device);
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    check(api.reset_peak(device), "resetPeakStats");
    pool_stats_.reset_peak(device);
  }
  // Each private pool's reserved bytes (pool_stats.h): what getDeviceStats gives torch 2.13+.
  std::vector<std::pair<MempoolId, c10::CachingAllocator::StatArray>> private_pool_reserved(
      c10::DeviceIndex device) {
    return pool_stats_.read(device);
  }

  // ---- snapshots and history ----
  CCA::SnapshotInfo snapshot(MempoolId mempool_id, bool include_traces) SYMM_OVERRIDE_SINCE_2_11 {
    CCA::SnapshotInfo s = hist_.snapshot(device_count_, mempool_id, include_traces);
    foreign_.add_segments(&s, mempool_id);  // MemPools with their own allocator
    return s;
  }
  bool isHistoryEnabled() override { return hist_.isHistoryEnabled(); }
  // The context recorded for the live block at `ptr` (its base address), as PyTorch's
  // getContextForPointer (torch 2.12+, torch.cuda.memory._allocation_traceback): nullptr when
  // none was recorded.
  std::shared_ptr<c10::GatheredContext> context_for(const void* ptr) {
    return hist_.context_of(ptr);
  }
#if SYMM_TORCH_HAS_CONTEXT_FOR_POINTER
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override {
    return context_for(ptr);
  }
#endif
  std::string history_state() {
    return hist_.state() + ", device count " + std::to_string(device_count_) + ", routes open " +
           std::to_string(routes_open_.load()) +
           ", foreign routes " + std::to_string(foreign_.routes()) + ", caching " +
           std::to_string(caching_.load()) + ", conf fraction " +
           std::to_string(conf_fraction_.load()) +
           " (pending on devices " + std::to_string(conf_pending_.load()) + " as a mask)";
  }
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CCA::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) SYMM_OVERRIDE_SINCE_2_11 {
    hist_.recordHistory(enabled, context_recorder, alloc_trace_max_entries, when, clearHistory,
                        skip_actions);
  }
  void pushCompileContext(std::string& md) override { hist_.pushCompileContext(md); }
  void popCompileContext() override { hist_.popCompileContext(); }
  void setUserMetadata(const std::string& metadata) override { hist_.setUserMetadata(metadata); }
  std::string getUserMetadata() override { return hist_.getUserMetadata(); }
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    hist_.attachOutOfMemoryObserver(std::move(observer));
  }
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override {
    hist_.attachAllocatorTraceTracker(std::move(tracker));
  }
#if SYMM_TORCH_AT_LEAST(2, 12)
  // PyTorch calls these observers when its throw_on_cudamalloc_oom policy rejects a request
  // before cudaMalloc. symmalloc has no such policy (install_global() refuses the key), so none
  // is ever called: kept for the process, as PyTorch keeps them.
  void attachOomRejectionObserver(CCA::OomRejectionObserver observer) override {
    oom_rejection_observers_.push_back(std::move(observer));
  }
#endif
#if SYMM_TORCH_AT_LEAST(2, 14)
  // setUserMetadata's string goes onto every trace entry (history.h), so say so
  // (torch._C._cuda_memoryMetadataSupported()). annotateMemory keeps PyTorch's default: a
  // warning that the annotation is ignored (no "annotate" trace entry; docs/memory.md).
  bool supportsUserMetadata() override { return true; }
#endif

  // ---- pools and graph capture ----
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId id,
                           std::function<bool(cudaStream_t)> filter) override {
    if (foreign_.begin(device, id, filter, routes_open_)) return;
    pool_stats_.note(device, id);
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
    if (foreign_.end(device, id, routes_open_)) return;
    api.end_pool(device, id.first, id.second);
    if (routes_open_.load() > 0) routes_open_.fetch_sub(1);
    std::string e = last_error();
    TORCH_CHECK(e.empty(), "symmalloc: endAllocateToPool failed: ", e);
#if SYMM_TORCH_HAS_PRIVATE_POOL_STATS
    pool_stats_.sample(device, id);  // what the route added (pool_stats.h)
#endif
  }

  void releasePool(c10::DeviceIndex device, MempoolId id) override {
    if (foreign_.release(id)) return;
    auto ctx = hist_.active() ? hist_.gather(CCA::RecordContext::ALL) : nullptr;
#if SYMM_TORCH_HAS_PRIVATE_POOL_STATS
    pool_stats_.sample(device, id);  // its peak before its segments go (pool_stats.h)
#endif
    api.release_pool(device, id.first, id.second);
    std::string e = last_error();
    hist_.note_segments(std::move(ctx));  // segment_free of the pool's free segments
#if SYMM_TORCH_HAS_PRIVATE_POOL_STATS
    pool_stats_.sample(device, id);
#endif
    // Called from CUDAGraph::reset (a destructor): warn, never throw there.
    if (!e.empty()) TORCH_WARN("symmalloc: releasePool failed: ", e);
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId id) override {
    int foreign_uses = 0;
    if (foreign_.uses(id, &foreign_uses)) return foreign_uses;
    uint64_t uses = 0;
    check(api.pool_uses(device, id.first, id.second, &uses), "getPoolUseCount");
    return (int)uses;
  }

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) SYMM_OVERRIDE_SINCE_2_11 {
    // A MemPool in global mode: with no allocator of its own its blocks come from symmalloc's
    // heap, in a pool of its own; with one (a MemPool(allocator=...), NCCL's for buffer
    // registration, say) its blocks come from that allocator, as PyTorch's allocator does it.
    if (allocator && allocator.get() != this) {
      foreign_.adopt(id, std::move(allocator));
      return;
    }
    check(api.pool_hold(device, id.first, id.second), "createOrIncrefPool");
    pool_stats_.note(device, id);
  }

  void setUseOnOOM(c10::DeviceIndex device, MempoolId id,
                   bool use_on_oom) SYMM_OVERRIDE_SINCE_2_11 {
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
    return pool_live_is(device, id, expected);
  }

  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId id) override {
    return checkpoint_pool(device, id);
  }

  CCA::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<CCA::AllocatorState> pps) override {
    return restore_pool(device, std::move(pps), &raw_deleter_fn);
  }

  // ---- sharing across processes and devices ----
  // CUDA IPC in PyTorch's handle formats, both ways (ipc.h).
  CCA::ShareableHandle shareIpcHandle(void* ptr) override {
    auto shared = share_block(ptr);
    return CCA::ShareableHandle{shared.second, std::move(shared.first)};
  }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return ipc_imports_.open(handle);
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard g(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
    check(api.grant_peer_access(dev_to_access, dev), "symm_grant_peer_access");
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::string name() override { return "symmalloc"; }

#if !SYMM_TORCH_AT_LEAST(2, 11)
  // torch 2.10's signatures of the methods 2.11 changed: each calls the 2.11 form above.
  CCA::SnapshotInfo snapshot(MempoolId mempool_id) override {
    return snapshot(mempool_id, /*include_traces=*/true);
  }
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CCA::RecordContext when,
                     bool clearHistory) override {
    recordHistory(enabled, context_recorder, alloc_trace_max_entries, when, clearHistory, {});
  }
  // 2.10's MemPool keeps its allocator alive and passes it by pointer (PyTorch's allocator keeps
  // the pointer): held here without owning it, as there.
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId id,
                          CCA::CUDAAllocator* allocator) override {
    createOrIncrefPool(device, id,
                       allocator ? std::shared_ptr<CCA::CUDAAllocator>(
                                       allocator, [](CCA::CUDAAllocator*) {})
                                 : nullptr);
  }
  // 2.10's MemPool calls it only for use_on_oom=True.
  void setUseOnOOM(c10::DeviceIndex device, MempoolId id) override {
    setUseOnOOM(device, id, /*use_on_oom=*/true);
  }
#endif

  int device_count() const { return device_count_; }

 private:
  void check_device(c10::DeviceIndex device, const char* what) {
    TORCH_CHECK(device >= 0 && (size_t)device < fraction_.size(), "symmalloc: ", what,
                ": device ", int(device), " does not exist; expected 0..",
                (int)fraction_.size() - 1);
  }

  void report_to_profiler(int device, void* p, int64_t delta) {
    SymmDeviceStats s{};
    if (api.device_stats(device, &s, sizeof s) != kSuccess) return;
    c10::reportMemoryUsageToProfiler(p, delta, (size_t)s.allocated_bytes[0].current,
                                     (size_t)s.reserved_bytes[0].current,
                                     c10::Device(c10::DeviceType::CUDA, (c10::DeviceIndex)device));
  }

  symm_torch::ForeignPools foreign_;

  int device_count_ = 0;
  bool initialized_ = false;
  std::vector<double> fraction_ = std::vector<double>(64, 1.0);
  // per_process_memory_fraction (configure, set_conf_fraction: install or run time)
  std::atomic<double> conf_fraction_{1.0};
  std::atomic<uint64_t> conf_pending_{0};   // devices whose cap is still to be set from it

  symm_torch::History hist_;
  symm_torch::PoolStats pool_stats_;
#if SYMM_TORCH_AT_LEAST(2, 12)
  std::vector<CCA::OomRejectionObserver> oom_rejection_observers_;
#endif
  std::atomic<bool> caching_{true};
  symm_torch::Uncached uncached_;
  symm_torch::StreamUses uses_;
  symm_torch::IpcImports ipc_imports_;  // handles opened from other processes (getIpcDevPtr)
  // Pool routes open (graph captures and MemPool contexts): PyTorch's "captures underway".
  std::atomic<int> routes_open_{0};
};

// Never destroyed, as PyTorch's own allocator: blocks are freed during interpreter and static
// teardown (tensors held by torch's own statics), after a static here would be gone, and the
// recorded contexts hold Python frames that must not be released once Python has finalized (a
// destructor here did: "malloc(): unsorted double linked list corrupted" at exit, 1 of 3 full
// ported-test runs, one H200, 2026-12-03).
std::shared_ptr<SymmAllocator>& instance() {
  static auto* a = new std::shared_ptr<SymmAllocator>();
  return *a;
}

void raw_deleter_fn(void* ptr) { instance()->free_ptr(ptr); }

#ifndef SYMM_TORCH_PROFILE
const char* const kNotProfiling =
    "this build of the C++ allocator does not profile: build it with -DSYMM_TORCH_PROFILE "
    "(python -m symmalloc._torch_ext --build DIR --profile; docs/memory.md)";
#endif

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

// The running torch's headers this file was built against, as a hash (SYMM_TORCH_ABI, given by
// _torch_ext.build: the c10/ and torch/ headers csrc includes, version.h aside), and the CUDA
// version of that torch (SYMM_TORCH_CUDA). The package accepts a library built for another
// patch release of the same minor only when both match (docs/memory.md, "Torch versions").
#ifndef SYMM_TORCH_ABI
#define SYMM_TORCH_ABI ""
#endif
#ifndef SYMM_TORCH_CUDA
#define SYMM_TORCH_CUDA ""
#endif
const char* symm_torch_abi() { return SYMM_TORCH_ABI; }
const char* symm_torch_built_cuda() { return SYMM_TORCH_CUDA; }

// Sets PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction (1: none) and whether caching is
// on (PYTORCH_NO_CUDA_MEMORY_CACHING: off) on the allocator symm_torch_install made. 0 on
// success; 1 with a message in err (no allocator made, a fraction outside [0, 1]).
int symm_torch_configure(double fraction, int caching, char* err, size_t len) {
  if (!instance()) return fail(err, len, "no allocator was made (symm_torch_install first)");
  if (!(fraction >= 0.0 && fraction <= 1.0))
    return fail(err, len, "per_process_memory_fraction " + std::to_string(fraction) +
                              ": expected a fraction in [0, 1]");
  instance()->configure(fraction, caching != 0);
  return 0;
}

// Makes the allocator over the library at `library_path` and installs it as PyTorch's CUDA
// allocator. 0 on success; otherwise 1 and a message in err (PyTorch's allocator already in
// use, a library without the calls this needs).
int symm_torch_install(const char* library_path, char* err, size_t len) {
  try {
    if (int r = make(library_path, err, len)) return r;
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(instance());
    // _set_allocator_settings: honoured or refused by name at the call (settings.h).
    symm_torch::install_settings_hook([](double f) { instance()->set_conf_fraction(f); });
    // torch.accelerator's memory API reads c10::GetAllocator(kCUDA): the same object.
    c10::SetAllocator(c10::DeviceType::CUDA, instance().get(), /*priority=*/255);
    return 0;
  } catch (const std::exception& e) {
    return fail(err, len, e.what());
  }
}

// The time spent in allocations and frees per thread since the last call, as JSON in `out`
// (set to zero); 1 with a message there when this build does not profile (SYMM_TORCH_PROFILE,
// profile.h).
int symm_torch_profile(char* out, size_t len) {
#ifdef SYMM_TORCH_PROFILE
  std::string s = symm_torch::prof::take_all();
  if (s.size() >= len)
    return fail(out, len, "the profile (" + std::to_string(s.size()) + " bytes) does not fit in " +
                              std::to_string(len) + " bytes");
  std::snprintf(out, len, "%s", s.c_str());
  return 0;
#else
  return fail(out, len, kNotProfiling);
#endif
}

// Events of every allocation and free from now (on = 1), or written to `path` as CSV
// (on = 0); 1 with a message in err when this build does not profile or the file cannot be
// written.
int symm_torch_profile_trace(int on, const char* path, char* err, size_t len) {
#ifdef SYMM_TORCH_PROFILE
  std::string e = symm_torch::prof::trace(on != 0, path);
  return e.empty() ? 0 : fail(err, len, e);
#else
  (void)on;
  (void)path;
  return fail(err, len, kNotProfiling);
#endif
}

// The memory history's state in one line (what is recorded, the trace ring's size, open pool
// routes, caching): for diagnosis. 1 when no allocator was made.
int symm_torch_history_state(char* out, size_t len) {
  if (!instance()) return fail(out, len, "no allocator was made");
  if (out && len) std::snprintf(out, len, "%s", instance()->history_state().c_str());
  return 0;
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
    std::string failure = symm_torch::selftest(*instance(), device);
    if (!failure.empty()) return fail(err, len, failure);
    return 0;
  } catch (const std::exception& e) {
    return fail(err, len, std::string("selftest: ") + e.what());
  }
}

// For host tests that drive the allocator symm_torch_selftest or symm_torch_install made from
// Python threads (selftest.h), each 0, or 1 with the failure in err:
// - symm_torch_host_churn: `iters` allocations and frees on `device` (call it with the GIL
//   released: ctypes.CDLL);
// - symm_torch_host_history: history recorded (context "all") with a recorder that calls `hook`
//   (a ctypes callback: it takes the GIL, as PyTorch's Python recorder does), or off;
// - symm_torch_host_snapshot: a snapshot with its trace, as torch.cuda.memory._snapshot takes
//   it (call it holding the GIL: ctypes.PyDLL), its segments and framed allocations counted.
int symm_torch_host_churn(int device, int iters, uint64_t seed, char* err, size_t len) {
  if (!instance()) return fail(err, len, "no allocator was made");
  std::string failure = symm_torch::churn(*instance(), device, iters, seed);
  return failure.empty() ? 0 : fail(err, len, failure);
}
int symm_torch_host_history(int on, void (*hook)(), char* err, size_t len) {
  if (!instance()) return fail(err, len, "no allocator was made");
  symm_torch::host_hook().store(on ? hook : nullptr);
  instance()->recordHistory(on != 0, on ? &symm_torch::hook_recorder : nullptr, 1 << 20,
                            on ? CCA::RecordContext::ALL : CCA::RecordContext::NEVER, true, {});
  return 0;
}
int symm_torch_host_snapshot(size_t* segments, size_t* allocs, char* err, size_t len) {
  if (!instance()) return fail(err, len, "no allocator was made");
  if (!segments || !allocs) return fail(err, len, "segments or allocs is NULL");
  try {
    std::tie(*segments, *allocs) = symm_torch::snapshot_counts(*instance());
    return 0;
  } catch (const std::exception& e) {
    return fail(err, len, e.what());
  }
}

}  // extern "C"
