// symmalloc's C++ allocator for PyTorch: CUDA IPC (torch.multiprocessing), both ways, in
// PyTorch's own handle formats. Included by torch_allocator.cpp only (shareIpcHandle and
// getIpcDevPtr call share_block and IpcImports::open).
//
// Owns: the byte format of a shareable handle (encode/parse, host-testable), the export of a
// live block (symm_segment_export: its physical chunks as descriptors this process keeps open),
// and the cache of handles opened from other processes (one mapping per handle string, held by
// weak_ptr as PyTorch's ipcMemHandle_to_devptr, unmapped at the last release).
//
// The format (c10/cuda/CUDACachingAllocator.cpp; read from libc10_cuda.so of 2.11 and 2.15):
//   byte 0: version; byte 1: 'c' (cudaMalloc: a 64-byte cudaIpcMemHandle_t follows) or 'e'
//   (expandable segment: a ShareHeader, then num_handles memory handles: ints, descriptor
//   numbers in process `pid`, each of segment_size bytes, mapped one after another; or 64-byte
//   CUmemFabricHandles). A handle of exactly 64 bytes is a raw cudaIpcMemHandle_t (older torch).
//   Version 2 (torch 2.10, 2.11): ShareHeader{pid_t pid; 4 bytes padding; size_t segment_size;
//   size_t num_handles} = 24 bytes; which memory handles follow is the receiver's own setting.
//   Version 3 (torch 2.15; PyTorch #179618): the header gains `int handle_type` (1 POSIX fd,
//   2 fabric) after num_handles, 4 bytes padding after it = 32 bytes. Torch 2.12 to 2.14 are
//   probed at run time (send_version: does the running libc10_cuda.so read version 3?).
//   The ShareableHandle's offset is the block's distance from the first handle's start.
//   Fabric handles are refused by name here (symmalloc exports POSIX descriptors).
// Invariants:
// - symmalloc sends 'e' only: its memory is cuMemCreate'd (POSIX-fd exportable), never
//   cudaMalloc'd. A block is sent only when the chunks under it are of one size and contiguous
//   (PyTorch's receiver maps num_handles * segment_size bytes): else a c10::Error says so and
//   nothing changes.
// - The producer keeps the memory: PyTorch's CudaIPCSentData holds the block's DataPtr until
//   every consumer let go, so the block stays live and its chunks stay in the heap with their
//   descriptors open; a chunk generation's descriptors close at emptyCache (close_stale_exports)
//   or the next export after the heap gave that chunk back. A consumer's mapping holds the
//   physical memory on its own.
// - A malformed handle is refused before any CUDA call, naming what is wrong.
#pragma once

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "api.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

constexpr char kIpcCudaMalloc = 'c';
constexpr char kIpcExpandable = 'e';
constexpr size_t kCudaIpcHandleSize = 64;  // CUDA_IPC_HANDLE_SIZE
constexpr size_t kFabricHandleSize = 64;   // sizeof(CUmemFabricHandle)
constexpr int kHandlePosixFd = 1, kHandleFabric = 2;  // Expandable_Segments_Handle_Type

// PyTorch's ExpandableSegment::ShareHeader, byte for byte (x86-64 and aarch64 Linux): version 2
// is its first 24 bytes, version 3 all 32.
struct IpcShareHeader {
  pid_t pid;
  size_t segment_size;
  size_t num_handles;
  int handle_type;  // version 3 only
};
static_assert(offsetof(IpcShareHeader, segment_size) == 8 &&
                  offsetof(IpcShareHeader, num_handles) == 16 &&
                  offsetof(IpcShareHeader, handle_type) == 24 && sizeof(IpcShareHeader) == 32,
              "PyTorch's ShareHeader is {int32 pid, pad 4, size_t, size_t, int32 type, pad 4}");
static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleSize, "cudaIpcMemHandle_t");

inline size_t header_size(int version) { return version >= 3 ? 32 : 24; }

// Whether the file at `path` holds `needle` (read in 1 MiB pieces).
inline bool file_holds(const char* path, const std::string& needle) {
  FILE* f = std::fopen(path, "rb");
  if (!f) return false;
  std::string buf(1 << 20, '\0'), carry;
  bool found = false;
  size_t n;
  while (!found && (n = std::fread(&buf[0], 1, buf.size(), f)) > 0) {
    std::string chunk = carry + buf.substr(0, n);
    found = chunk.find(needle) != std::string::npos;
    carry = chunk.substr(chunk.size() > needle.size() ? chunk.size() - needle.size() : 0);
  }
  std::fclose(f);
  return found;
}

// The handle version the running libc10_cuda.so reads: 3 when it carries version 3's consumer
// (its message about a producer's fabric handle type), else 2.
inline int probe_version() {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&c10::cuda::device_count), &info) || !info.dli_fname)
    return 2;
  return file_holds(info.dli_fname, "received FABRIC handle from producer") ? 3 : 2;
}

// The handle version the running torch reads and writes: 2 up to 2.11, 3 from 2.15
// (torch_compat.h), probed for 2.12 to 2.14.
inline int send_version() {
#if SYMM_TORCH_IPC_VERSION_KNOWN
  return SYMM_TORCH_IPC_VERSION_KNOWN;
#else
  static int v = probe_version();
  return v;
#endif
}

// The 'e' handle of `version` for chunks of `segment_size` bytes each, exported as POSIX
// descriptors `fds` by process `pid`.
inline std::string encode_expandable(int version, pid_t pid, size_t segment_size,
                                     const std::vector<int>& fds) {
  IpcShareHeader h;
  std::memset(&h, 0, sizeof h);  // the padding too: PyTorch caches opened handles by their bytes
  h.pid = pid;
  h.segment_size = segment_size;
  h.num_handles = fds.size();
  h.handle_type = kHandlePosixFd;
  std::string out;
  out.push_back((char)version);
  out.push_back(kIpcExpandable);
  out.append(reinterpret_cast<const char*>(&h), header_size(version));
  for (int fd : fds) out.append(reinterpret_cast<const char*>(&fd), sizeof fd);
  return out;
}

// A handle as parsed: kind 'c' (cuda_handle) or 'e' (header and fds).
struct IpcHandle {
  char kind = 0;
  cudaIpcMemHandle_t cuda_handle{};
  IpcShareHeader header{};
  std::vector<int> fds;
};

// Parses a handle from any torch 2.10-2.15 producer (or symmalloc): throws c10::Error naming
// what is wrong.
inline IpcHandle parse_ipc_handle(const std::string& s) {
  IpcHandle out;
  if (s.size() == kCudaIpcHandleSize) {  // a raw cudaIpcMemHandle_t (older torch)
    out.kind = kIpcCudaMalloc;
    std::memcpy(&out.cuda_handle, s.data(), kCudaIpcHandleSize);
    return out;
  }
  TORCH_CHECK(s.size() >= 2, "symmalloc: malformed CUDA IPC handle: ", s.size(),
              " bytes; expected a version byte, a type byte and the handle");
  int version = s[0];
  TORCH_CHECK(version >= 1 && version <= 3, "symmalloc: CUDA IPC handle of version ", version,
              "; symmalloc reads versions 1 to 3 (torch 2.10-2.15's): was it sent by a newer "
              "torch?");
  out.kind = s[1];
  if (out.kind == kIpcCudaMalloc) {
    TORCH_CHECK(s.size() == 2 + kCudaIpcHandleSize, "symmalloc: malformed CUDA IPC handle: type "
                "'c' (cudaMalloc) needs ", 2 + kCudaIpcHandleSize, " bytes, got ", s.size());
    std::memcpy(&out.cuda_handle, s.data() + 2, kCudaIpcHandleSize);
    return out;
  }
  TORCH_CHECK(out.kind == kIpcExpandable, "symmalloc: malformed CUDA IPC handle: type byte ",
              (int)(unsigned char)out.kind, "; expected 'c' (cudaMalloc) or 'e' (expandable "
              "segment)");
  size_t hs = header_size(version);
  TORCH_CHECK(s.size() >= 2 + hs, "symmalloc: malformed CUDA IPC handle: type 'e' of version ",
              version, " needs a ", hs, "-byte header, got ", s.size(), " bytes in all");
  std::memcpy(&out.header, s.data() + 2, hs);
  if (version < 3) out.header.handle_type = kHandlePosixFd;  // the receiver's setting: ours
  size_t n = out.header.num_handles, rest = s.size() - 2 - hs;
  TORCH_CHECK(n > 0 && n <= (1u << 20), "symmalloc: malformed CUDA IPC handle: ", n,
              " memory handles; expected 1 or more");
  bool fabric = version >= 3 ? out.header.handle_type == kHandleFabric
                             : rest == n * kFabricHandleSize && rest != n * sizeof(int);
  TORCH_CHECK(!fabric, "symmalloc: this CUDA IPC handle carries fabric handles (the producer "
              "runs PyTorch with expandable_segments_handle_type fabric); symmalloc opens POSIX "
              "file-descriptor handles only: set the producer's handle type to posix_fd");
  TORCH_CHECK(out.header.handle_type == kHandlePosixFd, "symmalloc: malformed CUDA IPC handle: "
              "handle type ", out.header.handle_type, "; expected 1 (POSIX fd) or 2 (fabric)");
  TORCH_CHECK(rest == n * sizeof(int), "symmalloc: malformed CUDA IPC handle: ", n,
              " memory handles need ", n * sizeof(int), " bytes after the header, got ", rest);
  TORCH_CHECK(out.header.pid > 0, "symmalloc: malformed CUDA IPC handle: producer pid ",
              out.header.pid);
  TORCH_CHECK(out.header.segment_size > 0 && out.header.segment_size % 4096 == 0,
              "symmalloc: malformed CUDA IPC handle: segment size ", out.header.segment_size,
              "; expected a positive multiple of the mapping granularity");
  out.fds.resize(n);
  std::memcpy(out.fds.data(), s.data() + 2 + hs, rest);
  return out;
}

// A function of the library `api` was loaded from, by name (not in api.h's table: only sharing
// needs these); NULL when that library lacks it.
inline void* library_fn(const char* name) {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(api.malloc_checked), &info) || !info.dli_fname)
    return nullptr;
  void* h = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
  return h ? dlsym(h, name) : nullptr;
}

inline decltype(&symm_segment_export) segment_export_fn() {
  static auto fn =
      reinterpret_cast<decltype(&symm_segment_export)>(library_fn("symm_segment_export"));
  return fn;
}

// emptyCache: closes the descriptors kept for chunks the heap gave back (each holds its chunk's
// physical memory while open). Nothing when nothing was ever shared.
inline void close_stale_exports() {
  static auto fn = reinterpret_cast<decltype(&symm_segment_export_close_stale)>(
      library_fn("symm_segment_export_close_stale"));
  if (fn) (void)fn(nullptr);  // a failure here leaves descriptors open, as before the call
}

// shareIpcHandle: the 'e' handle of the live block starting at `ptr`, and the block's offset
// from its first chunk.
inline std::pair<std::string, ptrdiff_t> share_block(void* ptr) {
  auto fn = segment_export_fn();
  TORCH_CHECK(fn, "symmalloc: sharing a CUDA tensor with another process needs "
                  "symm_segment_export, which the loaded libsymmalloc lacks (an older library)");
  int device = 0;
  size_t size = 0;
  TORCH_CHECK(block_request(ptr, &device, &size), "symmalloc: shareIpcHandle(", ptr,
              "): not the start of a live block of symmalloc's heap: ", last_error());
  size_t n = 0;
  check(fn(ptr, nullptr, 0, &n), "symm_segment_export");
  std::vector<symm_export_chunk_t> chunks(n);
  check(fn(ptr, chunks.data(), chunks.size(), &n), "symm_segment_export");
  chunks.resize(std::min(n, chunks.size()));
  uint64_t lo = (uint64_t)ptr, hi = lo + std::max<size_t>(size, 1);
  std::vector<symm_export_chunk_t> under;
  for (const auto& c : chunks)
    if (c.address < hi && c.address + c.size > lo) under.push_back(c);
  TORCH_CHECK(!under.empty() && under.front().address <= lo && under.back().address +
              under.back().size >= hi, "symmalloc: shareIpcHandle(", ptr, "): the heap's "
              "chunks do not cover the block's ", size, " bytes");
  for (size_t i = 1; i < under.size(); ++i) {
    TORCH_CHECK(under[i].size == under[0].size && under[i].address ==
                under[i - 1].address + under[i - 1].size, "symmalloc: shareIpcHandle(", ptr,
                "): the block's ", size, " bytes lie over chunks of ", under[0].size, " and ",
                under[i].size, " bytes; PyTorch's IPC format needs chunks of one size, one "
                "after another. Clone the tensor (a fresh block) before sending it");
  }
  std::vector<int> fds;
  for (const auto& c : under) fds.push_back(c.fd);
  return {encode_expandable(send_version(), getpid(), (size_t)under[0].size, fds),
          (ptrdiff_t)(lo - under.front().address)};
}

// The CUDA driver's functions the import uses, from libcuda (the runtime PyTorch loaded).
struct IpcDriver {
  decltype(&::cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) address_free = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuGetErrorString) error_string = nullptr;

  static const IpcDriver& get() {
    static IpcDriver d = [] {
      IpcDriver x;
      void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
      TORCH_CHECK(h, "symmalloc: opening a CUDA IPC handle needs the CUDA driver (libcuda.so.1): ",
                  dlerror());
#define SYMM_DRV(field, name) \
  x.field = reinterpret_cast<decltype(x.field)>(dlsym(h, name)); \
  TORCH_CHECK(x.field, "symmalloc: libcuda.so.1 lacks " name)
      SYMM_DRV(import_handle, "cuMemImportFromShareableHandle");
      SYMM_DRV(reserve, "cuMemAddressReserve");
      SYMM_DRV(address_free, "cuMemAddressFree");
      SYMM_DRV(map, "cuMemMap");
      SYMM_DRV(unmap, "cuMemUnmap");
      SYMM_DRV(set_access, "cuMemSetAccess");
      SYMM_DRV(release, "cuMemRelease");
      SYMM_DRV(error_string, "cuGetErrorString");
#undef SYMM_DRV
      return x;
    }();
    return d;
  }
  void check(CUresult r, const char* what) const {
    if (r == CUDA_SUCCESS) return;
    const char* s = nullptr;
    error_string(r, &s);
    TORCH_CHECK(false, "symmalloc: opening a CUDA IPC handle: ", what, " failed: ",
                s ? s : "unknown error", " (", (int)r, ")");
  }
};

// This process's copy of descriptor `fd` of process `pid` (pidfd_getfd): throws naming why not.
inline int take_fd(int pidfd, pid_t pid, int fd) {
  long mine = syscall(SYS_pidfd_getfd, pidfd, fd, 0);
  if (mine >= 0) return (int)mine;
  int err = errno;
  TORCH_CHECK(err != ENOSYS, "symmalloc: opening a CUDA IPC handle needs pidfd_getfd (Linux "
              "5.6 or later); this kernel lacks it");
  TORCH_CHECK(err != EPERM, "symmalloc: pidfd_getfd(pid ", pid, ", fd ", fd, ") refused: this "
              "process may not ptrace the producer (another user; kernel.yama.ptrace_scope 1 "
              "lets only a parent take from its children, 2 needs CAP_SYS_PTRACE); run both as "
              "one user with ptrace_scope 0, or send the data through CPU memory");
  TORCH_CHECK(err != EBADF, "symmalloc: pidfd_getfd(pid ", pid, ", fd ", fd, "): the producer "
              "holds no such descriptor any more (its memory was freed before this process "
              "opened the handle?)");
  TORCH_CHECK(false, "symmalloc: pidfd_getfd(pid ", pid, ", fd ", fd, "): ", std::strerror(err));
}

// What getIpcDevPtr opened: one mapping per handle string, shared while in use.
class IpcImports {
 public:
  std::shared_ptr<void> open(const std::string& handle) {
    IpcHandle h = parse_ipc_handle(handle);  // before any lock or CUDA call
    std::lock_guard<std::mutex> g(mu_);
    auto it = cache_.find(handle);
    if (it != cache_.end()) {
      if (auto sp = it->second.lock()) return sp;
    }
    c10::DeviceIndex device = c10::cuda::current_device();
    std::shared_ptr<void> sp = h.kind == kIpcCudaMalloc ? open_cuda(h, device)
                                                        : open_expandable(h, device);
    cache_[handle] = sp;
    return sp;
  }

 private:
  std::shared_ptr<void> open_cuda(const IpcHandle& h, c10::DeviceIndex device) {
    c10::cuda::CUDAGuard guard(device);
    void* p = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h.cuda_handle, cudaIpcMemLazyEnablePeerAccess));
    return std::shared_ptr<void>(p, [this, device](void* q) {
      c10::cuda::CUDAGuard g(device);
      (void)cudaIpcCloseMemHandle(q);  // a deleter does not throw
      forget();
    });
  }

  std::shared_ptr<void> open_expandable(const IpcHandle& h, c10::DeviceIndex device) {
    const IpcDriver& drv = IpcDriver::get();
    pid_t pid = h.header.pid;
    long pidfd = syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0) {
      int err = errno;
      TORCH_CHECK(err != ENOSYS, "symmalloc: opening a CUDA IPC handle needs pidfd_open (Linux "
                  "5.3 or later); this kernel lacks it");
      TORCH_CHECK(err != ESRCH, "symmalloc: the process that shared this CUDA tensor (pid ",
                  pid, ") is gone");
      TORCH_CHECK(false, "symmalloc: pidfd_open(", pid, "): ", std::strerror(err));
    }
    size_t n = h.fds.size(), seg = h.header.segment_size;
    std::vector<CUmemGenericAllocationHandle> handles;
    auto undo = [&](CUdeviceptr base, size_t mapped) {
      for (size_t i = 0; i < mapped; ++i) (void)drv.unmap(base + i * seg, seg);
      for (auto x : handles) (void)drv.release(x);
      if (base) (void)drv.address_free(base, n * seg);
    };
    try {
      for (int fd : h.fds) {
        int mine = take_fd((int)pidfd, pid, fd);
        CUmemGenericAllocationHandle x = 0;
        CUresult r = drv.import_handle(&x, reinterpret_cast<void*>((uintptr_t)mine),
                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        close(mine);
        drv.check(r, "cuMemImportFromShareableHandle");
        handles.push_back(x);
      }
    } catch (...) {
      close((int)pidfd);
      undo(0, 0);
      throw;
    }
    close((int)pidfd);
    c10::cuda::CUDAGuard guard(device);
    (void)cudaFree(nullptr);  // the device's primary context current (a fresh consumer has none)
    CUdeviceptr base = 0;
    size_t mapped = 0;
    try {
      drv.check(drv.reserve(&base, n * seg, 0, 0, 0), "cuMemAddressReserve");
      for (; mapped < n; ++mapped)
        drv.check(drv.map(base + mapped * seg, seg, 0, handles[mapped], 0), "cuMemMap");
      CUmemAccessDesc desc{};
      desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      desc.location.id = device;
      desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      drv.check(drv.set_access(base, n * seg, &desc, 1), "cuMemSetAccess");
    } catch (...) {
      undo(base, mapped);
      throw;
    }
    for (auto x : handles) (void)drv.release(x);  // the mappings hold the memory
    void* p = reinterpret_cast<void*>(base);
    size_t total = n * seg;
    return std::shared_ptr<void>(p, [this, device, total](void* q) {
      const IpcDriver& d = IpcDriver::get();
      c10::cuda::CUDAGuard g(device);
      (void)cudaDeviceSynchronize();  // work on the mapping ends before it goes (as PyTorch)
      (void)d.unmap(reinterpret_cast<CUdeviceptr>(q), total);
      (void)d.address_free(reinterpret_cast<CUdeviceptr>(q), total);
      forget();
    });
  }

  // Drops the cache entries of released mappings (an entry a later open replaced is live, and
  // stays).
  void forget() {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = cache_.begin(); it != cache_.end();) {
      if (it->second.expired()) {
        it = cache_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::mutex mu_;
  std::map<std::string, std::weak_ptr<void>> cache_;
};

}  // namespace
}  // namespace symm_torch
