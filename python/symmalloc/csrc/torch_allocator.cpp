// symmalloc as PyTorch's CUDA allocator: every virtual method of
// c10::cuda::CUDACachingAllocator::CUDAAllocator (torch 2.11), over libsymmalloc's C ABI.
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
// checks).
//
// Invariants:
// - A DataPtr is (ptr, ctx = ptr, raw_deleter_fn, device), as PyTorch's own allocator makes
//   them: CUDA-graph trees compare deleters with raw_deleter() and swap them; the deleter frees
//   by address alone (symm_free_block: the block's own size and allocation stream).
// - The allocation path holds no lock of these files and calls no Python: one call into
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
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "api.h"
#include "checkpoint.h"
#include "foreign_pools.h"
#include "history.h"
#include "oom.h"
#include "profile.h"
#include "selftest.h"
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
    SYMM_PROF_ALLOC(p, n, stream);
    if (foreign_.routes() > 0) {
      if (void* q = foreign_.malloc(device, n, stream)) return q;
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
      if (hist_.recording()) hist_.note_alloc(device, p, n, stream);
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
    if (foreign_.live() > 0 && foreign_.free(ptr)) return;
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
    if (hist_.recording() || profiling) find_live(device_count_, ptr, &device, &size);
    if (hist_.recording()) hist_.note_free(ptr, device, size);
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

  void emptyCache(MempoolId mempool_id) override {
    // symmalloc gives back the free segments of the default pool and of released pools; a
    // live pool keeps its own, as PyTorch does. With a pool's id (torch 2.11's MemPool
    // destructor: releasePool, then emptyCache(id)) only that pool's cache is meant: its free
    // segments went back at its last releasePool (symm_release_pool), and the default pool's
    // cache stays (test_mempool_empty_cache: it emptied the whole cache, one H200, 2026-12-03).
    if (mempool_id.first != 0 || mempool_id.second != 0) return;
    bool tracing = hist_.recording();
    std::map<std::pair<int, uint64_t>, uint64_t> before;
    if (tracing) before = segments_now(device_count_);
    if (uses_.any_held() && routes_open_.load(std::memory_order_relaxed) == 0) free_held(true);
    api.empty_cache();
    std::string e = last_error();
    TORCH_CHECK(e.empty(), "symmalloc: empty_cache failed: ", e);
    if (tracing) {
      auto after = segments_now(device_count_);
      hist_.note_segments_freed(before, after);
    }
    hist_.reserved_changed();
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
    return to_device_stats(s);
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check(api.reset_accumulated(device), "resetAccumulatedStats");
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    check(api.reset_peak(device), "resetPeakStats");
  }

  // ---- snapshots and history ----
  CCA::SnapshotInfo snapshot(MempoolId mempool_id, bool include_traces) override {
    return hist_.snapshot(device_count_, mempool_id, include_traces);
  }
  bool isHistoryEnabled() override { return hist_.isHistoryEnabled(); }
  std::string history_state() {
    return hist_.state() + ", device count " + std::to_string(device_count_) + ", routes open " +
           std::to_string(routes_open_.load()) +
           ", foreign routes " + std::to_string(foreign_.routes()) + ", caching " +
           std::to_string(caching_.load());
  }
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CCA::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
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

  // ---- pools and graph capture ----
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId id,
                           std::function<bool(cudaStream_t)> filter) override {
    if (foreign_.begin(device, id, filter, routes_open_)) return;
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
  }

  void releasePool(c10::DeviceIndex device, MempoolId id) override {
    if (foreign_.release(id)) return;
    api.release_pool(device, id.first, id.second);
    std::string e = last_error();
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
                          std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    // A MemPool in global mode: with no allocator of its own its blocks come from symmalloc's
    // heap, in a pool of its own; with one (a MemPool(allocator=...), NCCL's for buffer
    // registration, say) its blocks come from that allocator, as PyTorch's allocator does it.
    if (allocator && allocator.get() != this) {
      foreign_.adopt(id, std::move(allocator));
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
    check(api.grant_peer_access(dev_to_access, dev), "symm_grant_peer_access");
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::string name() override { return "symmalloc"; }

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

  symm_torch::History hist_;
  std::atomic<bool> caching_{true};
  symm_torch::Uncached uncached_;
  symm_torch::StreamUses uses_;
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

}  // extern "C"
