// symmalloc's C++ allocator for PyTorch: what differs between the torch minors it supports
// (2.10 to 2.15). Included by api.h (and so by torch_allocator.cpp) only.
//
// Owns: the version test (SYMM_TORCH_AT_LEAST, from torch/headeronly/version.h, which every
// supported torch has), the refusal of a torch outside the range, and the names of PyTorch's
// history types where they moved: torch 2.10 declares TraceEntry, BlockInfo and SegmentInfo in
// c10::cuda::CUDACachingAllocator with cudaStream_t fields; 2.11 moved them to
// c10::CachingDeviceAllocator with void* fields.
//
// Invariants:
// - A torch below 2.10 or above 2.15 does not compile: each minor changed CUDAAllocator's
//   virtual methods (a new pure virtual, a new parameter), so an untested one could build an
//   allocator that silently answers wrong. Extending the range means reading the new
//   CUDACachingAllocator.h and guarding each change here or at the method it touches.
// - Nothing here has state or code on the allocation path.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <cuda_runtime_api.h>
#include <torch/headeronly/version.h>

#include <type_traits>

#define SYMM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||       \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !SYMM_TORCH_AT_LEAST(2, 10) || SYMM_TORCH_AT_LEAST(2, 16)
#error "symmalloc's C++ allocator supports torch 2.10 to 2.15 (docs/memory.md, 'Torch versions')"
#endif

// On a method whose signature torch 2.11 changed: an override from 2.11, an overload before
// (torch_allocator.cpp then overrides 2.10's signature and calls it).
#if SYMM_TORCH_AT_LEAST(2, 11)
#define SYMM_OVERRIDE_SINCE_2_11 override
#else
#define SYMM_OVERRIDE_SINCE_2_11
#endif

// SegmentInfo::registration_counter (the order NCCL's symmetric registration walks a pool's
// segments in) exists from torch 2.11.
#define SYMM_TORCH_HAS_REGISTRATION_COUNTER SYMM_TORCH_AT_LEAST(2, 11)

// CUDAAllocator::getContextForPointer (torch.cuda.memory._allocation_traceback) exists from
// torch 2.12.
#define SYMM_TORCH_HAS_CONTEXT_FOR_POINTER SYMM_TORCH_AT_LEAST(2, 12)

// DeviceStats::reserved_bytes_by_private_pools (memory_stats' nested dict keyed by MempoolId)
// exists from torch 2.13.
#define SYMM_TORCH_HAS_PRIVATE_POOL_STATS SYMM_TORCH_AT_LEAST(2, 13)

// The device hook that c10::CachingAllocator::setAllocatorSettings (torch.cuda.memory.
// _set_allocator_settings, torch._C._accelerator_setAllocatorSettings) calls after the generic
// parse: readable through the public AcceleratorAllocatorConfig::getConfigParserHook() from
// torch 2.11 (an inline function's static up to 2.12, a function of libc10 from 2.13; either
// way one object in the process: the inline one is a GNU unique symbol). torch 2.10 keeps it
// in a private member: settings.h then replaces it without reading it.
#define SYMM_TORCH_HAS_CONFIG_HOOK_GETTER SYMM_TORCH_AT_LEAST(2, 11)

// The version of PyTorch's CUDA IPC handle of an expandable segment (csrc/ipc.h): 2 (24-byte
// header) in 2.10 and 2.11, 3 (32-byte header with the handle type) in 2.15, both read from
// those wheels' libc10_cuda.so; 0 for 2.12 to 2.14: probed at run time.
#if SYMM_TORCH_AT_LEAST(2, 15)
#define SYMM_TORCH_IPC_VERSION_KNOWN 3
#elif SYMM_TORCH_AT_LEAST(2, 12)
#define SYMM_TORCH_IPC_VERSION_KNOWN 0
#else
#define SYMM_TORCH_IPC_VERSION_KNOWN 2
#endif

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

#if SYMM_TORCH_AT_LEAST(2, 11)
using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::SegmentInfo;
using c10::CachingDeviceAllocator::TraceEntry;
#else
using c10::cuda::CUDACachingAllocator::BlockInfo;
using c10::cuda::CUDACachingAllocator::SegmentInfo;
using c10::cuda::CUDACachingAllocator::TraceEntry;
#endif

// The type of a trace entry's and a segment's stream (void* from 2.11, cudaStream_t before).
using TraceStream = decltype(TraceEntry::stream_);
static_assert(std::is_same_v<TraceStream, decltype(SegmentInfo::stream)>,
              "TraceEntry::stream_ and SegmentInfo::stream have one type");

}  // namespace
}  // namespace symm_torch
