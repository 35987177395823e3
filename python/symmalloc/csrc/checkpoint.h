// symmalloc's C++ allocator for PyTorch: a private pool's checkpoints, as CUDA-graph trees use
// them (torch/_inductor/cudagraph_trees.py). Included by torch_allocator.cpp only.
//
// Owns: the checkpoint of one pool (SymmCheckpoint: its live blocks, as getCheckpointState
// takes it), the check that a pool holds exactly the blocks expected
// (checkPoolLiveAllocations), and the restore of a checkpoint (setCheckpointPoolState, through
// symm_pool_restore), with the DataPtrs it hands back.
//
// Invariants:
// - A checkpoint holds the live blocks as the heap listed them; the restore hands them back to
//   libsymmalloc unchanged (symm_pool_restore: each live again at its address, size, request
//   and stream) after the blocks live in the pool now are freed.
// - The restore's DataPtrs are made as every DataPtr of the allocator is: (ptr, ctx = ptr,
//   the raw deleter the caller passes, device).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <memory>
#include <unordered_set>
#include <vector>

#include "api.h"

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

// A checkpoint of one pool (CUDA-graph trees): its live blocks.
struct SymmCheckpoint final : CCA::AllocatorState {
  c10::DeviceIndex device;
  MempoolId pool;
  std::vector<SymmBlock> blocks;
};

// checkPoolLiveAllocations: the pool's live blocks are exactly `expected`.
inline bool pool_live_is(c10::DeviceIndex device, MempoolId id,
                         const std::unordered_set<void*>& expected) {
  size_t live = 0;
  for (const auto& b : list_blocks(device, &id)) {
    if (b.state != kBlockLive) continue;
    ++live;
    if (!expected.count((void*)b.address)) return false;
  }
  return live == expected.size();
}

// getCheckpointState.
inline std::shared_ptr<CCA::AllocatorState> checkpoint_pool(c10::DeviceIndex device,
                                                            MempoolId id) {
  auto st = std::make_shared<SymmCheckpoint>();
  st->device = device;
  st->pool = id;
  for (const auto& b : list_blocks(device, &id))
    if (b.state == kBlockLive) st->blocks.push_back(b);
  return st;
}

// setCheckpointPoolState: the pool back at `pps`, its DataPtrs with `deleter`.
inline CCA::CheckpointDelta restore_pool(c10::DeviceIndex device,
                                         std::shared_ptr<CCA::AllocatorState> pps,
                                         c10::DeleterFnPtr deleter) {
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
    delta.dataptrs_allocd.emplace_back(p, p, deleter,
                                       c10::Device(c10::DeviceType::CUDA, device));
  }
  return delta;
}

}  // namespace
}  // namespace symm_torch
