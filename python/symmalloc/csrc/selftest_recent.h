// symmalloc's C++ allocator for PyTorch: the host backend's checks of what newer torch minors
// ask of it, run by selftest() (selftest.h) on every torch the selftest is built against (the
// version-independent helpers always; the overrides where the running torch has them):
// getContextForPointer (2.12+: history.h's context_of), reserved_bytes_by_private_pools (2.13+:
// pool_stats.h) and the rules for settings changed at run time (settings.h; the hook itself is
// tested through install_global() in python/tests/test_torch_allocator.py, since the selftest
// never installs the allocator).
//
// Invariants: as selftest.h's (each check named by its failure; every block made is freed and
// every pool released before returning, when the checks hold).
#pragma once

#include <c10/util/Exception.h>

#include <memory>
#include <string>

#include "api.h"
#include "settings.h"

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

template <typename Allocator>
std::string selftest_recent(Allocator& a, int device) {
#define EXPECT(cond, what) \
  if (!(cond)) return std::string("selftest (recent torch): ") + (what)

  // getContextForPointer: the context of a live block recorded while history was on, looked up
  // by the block's base address; nothing for an inner address, a block allocated without a
  // recorder, or a freed block.
  a.recordHistory(true, [] { return std::make_shared<c10::GatheredContext>(); }, 100,
                  CCA::RecordContext::STATE, true, {});
  void* framed = a.malloc_on(device, 4096, nullptr);
  a.recordHistory(false, nullptr, 0, CCA::RecordContext::NEVER, true, {});
  void* bare = a.malloc_on(device, 4096, nullptr);
  auto ctx = a.context_for(framed);
  EXPECT(ctx != nullptr, "context_for gives the recorded context of a live block");
  EXPECT(a.context_for(static_cast<char*>(framed) + 512) == nullptr,
         "context_for of an inner address is nothing (PyTorch looks up the base address)");
  EXPECT(a.context_for(bare) == nullptr, "context_for of a block allocated unrecorded");
#if SYMM_TORCH_HAS_CONTEXT_FOR_POINTER
  CCA::CUDAAllocator& base = a;
  EXPECT(base.getContextForPointer(framed) == ctx, "getContextForPointer is context_for");
#endif
  a.raw_delete(framed);
  EXPECT(a.context_for(framed) == nullptr, "a freed block has no context");
  a.raw_delete(bare);

  // reserved_bytes_by_private_pools: a pool's segments by class, its peak and accumulated
  // bytes kept after its release (current 0), reset like the others.
  MempoolId pool{0, 9101};
  auto stat_of = [&](MempoolId id, bool* found) {
    *found = false;
    c10::CachingAllocator::StatArray out{};
    for (const auto& [p, st] : a.private_pool_reserved(device))
      if (p == id) {
        *found = true;
        out = st;
      }
    return out;
  };
  bool found = false;
  stat_of(pool, &found);
  EXPECT(!found, "a pool never handed to the allocator is not listed");
  a.createOrIncrefPool(device, pool, nullptr);
  a.beginAllocateToPool(device, pool, [](cudaStream_t) { return true; });
  void* small = a.malloc_on(device, 1000, nullptr);
  void* large = a.malloc_on(device, 6 << 20, nullptr);
  a.endAllocateToPool(device, pool);
  size_t large_segment = 0;
  (void)a.getBaseAllocation(large, &large_segment);
  auto st = stat_of(pool, &found);
  EXPECT(found, "a pool in use is listed");
  EXPECT(st[1].current == (2 << 20), "the small block's 2 MiB segment counted in small: " +
                                         std::to_string(st[1].current));
  EXPECT(st[2].current == (int64_t)large_segment,
         "the large block's segment counted in large: " + std::to_string(st[2].current) +
             " of " + std::to_string(large_segment));
  EXPECT(st[0].current == st[1].current + st[2].current && st[0].peak == st[0].current &&
             st[0].allocated == st[0].current && st[0].freed == 0,
         "aggregate = small + large, peak and allocated as held");
  stat_of({0, 0}, &found);
  EXPECT(!found, "the default pool is not a private pool");
#if SYMM_TORCH_HAS_PRIVATE_POOL_STATS
  {
    auto ds = a.getDeviceStats(device);
    auto it = ds.reserved_bytes_by_private_pools.find(pool);
    EXPECT(it != ds.reserved_bytes_by_private_pools.end() &&
               it->second[0].current == st[0].current,
           "getDeviceStats carries the pool's reserved bytes");
  }
#endif
  int64_t held = st[0].current;
  a.raw_delete(small);
  a.raw_delete(large);
  a.releasePool(device, pool);  // the begin's use
  a.releasePool(device, pool);  // the MemPool's: its segments go back
  st = stat_of(pool, &found);
  EXPECT(found && st[0].current == 0 && st[0].peak == held && st[0].freed == held,
         "a released pool reads current 0 with its peak and freed bytes kept");
  a.resetPeakStats(device);
  a.resetAccumulatedStats(device);
  stat_of(pool, &found);
  EXPECT(!found, "a released pool with nothing left to report goes at the resets");
#if SYMM_TORCH_HAS_PRIVATE_POOL_STATS
  {
    // No read while the pool lived: its route's end and its release were seen all the same.
    MempoolId unread{0, 9102};
    a.createOrIncrefPool(device, unread, nullptr);
    a.beginAllocateToPool(device, unread, [](cudaStream_t) { return true; });
    void* b = a.malloc_on(device, 6 << 20, nullptr);
    a.endAllocateToPool(device, unread);
    a.raw_delete(b);
    a.releasePool(device, unread);
    a.releasePool(device, unread);
    auto u = stat_of(unread, &found);
    EXPECT(found && u[0].current == 0 && u[0].peak >= (6 << 20) && u[0].freed == u[0].peak,
           "a pool never read while it lived reports its peak and freed bytes");
  }
#endif

  // The rules for _set_allocator_settings (settings.h), as install_global() applies them.
  double f = 0;
  EXPECT(check_settings("per_process_memory_fraction:0.5, pinned_num_register_threads:4", &f)
                 .empty() && f == 0.5,
         "the fraction and a pinned_* key are honoured");
  EXPECT(check_settings("expandable_segments:False,backend:native", &f).empty() && f == -1.0,
         "PyTorch's defaults are honoured, with no fraction");
  std::string e = check_settings(
      "max_split_size_mb:64,expandable_segments:True,roundup_power2_divisions:[256:1,>:4]", &f);
  EXPECT(e.find("max_split_size_mb:64") != std::string::npos &&
             e.find("expandable_segments:True") != std::string::npos &&
             e.find("roundup_power2_divisions:[256:1,>:4]") != std::string::npos,
         "every refused key is named: " + e);
  EXPECT(check_settings("per_process_memory_fraction:1.5", &f).find("[0, 1]") != std::string::npos,
         "a fraction outside [0, 1] is refused");
#undef EXPECT
  return "";
}

}  // namespace
}  // namespace symm_torch
