// symmalloc's C++ allocator for PyTorch: the host backend's checks of CUDA IPC (ipc.h), run by
// selftest.h's selftest. Included by selftest.h only.
//
// Owns: selftest_ipc, which checks (no CUDA runtime needed) the 'e' handle shareIpcHandle makes
// byte for byte as PyTorch's receiver reads it (the running torch's version, 2 or 3, and the
// probe of its libc10_cuda.so against what torch_compat.h knows; type, ShareHeader with zero
// padding, descriptor numbers, offset; both versions encoded and parsed back), that the
// descriptors are the block's memory (taken with pidfd_getfd as PyTorch's receiver takes them,
// mapped one after another: both see each other's writes), that a second share gives the
// same bytes (PyTorch caches opened handles by them), and that bad input (an interior pointer,
// malformed handles of every kind) is refused by name, before any CUDA call.
//
// Invariants: every block it makes is freed and every mapping unmapped before it returns.
#pragma once

#include <sys/mman.h>

#include <cstring>
#include <string>
#include <vector>

#include "ipc.h"

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

// The message of what `f` throws, or "" when it does not throw.
template <typename F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

template <typename Allocator>
std::string selftest_ipc(Allocator& a, int device) {
#define IPC_EXPECT(cond, what) \
  if (!(cond)) return std::string("selftest (ipc): ") + what
  const size_t kSize = 3 << 20;
  // A small block after a large one: its offset in its chunk is not zero.
  void* first = a.malloc_on(device, 1 << 20, nullptr);
  auto* p = static_cast<unsigned char*>(a.malloc_on(device, kSize, nullptr));
  for (size_t i = 0; i < kSize; ++i) p[i] = (unsigned char)(i * 31 + 1);
  CCA::ShareableHandle sh = a.shareIpcHandle(p);
  const std::string& s = sh.handle;
#if SYMM_TORCH_IPC_VERSION_KNOWN
  IPC_EXPECT(probe_version() == SYMM_TORCH_IPC_VERSION_KNOWN,
             "the probe of libc10_cuda.so finds the handle version this torch is known to use");
#endif
  const int version = send_version();
  const size_t hs = version >= 3 ? 32 : 24;
  IPC_EXPECT(s.size() >= 2 + hs + 4 && s[0] == version && s[1] == 'e',
             "the handle starts with the running torch's version and type 'e'");
  IPC_EXPECT((s.size() - 2 - hs) % 4 == 0, "ints follow the header");
  pid_t pid;
  size_t seg, n;
  std::memcpy(&pid, s.data() + 2, 4);
  std::memcpy(&seg, s.data() + 10, 8);
  std::memcpy(&n, s.data() + 18, 8);
  IPC_EXPECT(pid == getpid(), "the header's pid is this process");
  IPC_EXPECT(s[6] == 0 && s[7] == 0 && s[8] == 0 && s[9] == 0, "the header's padding is zero");
  if (version >= 3) {
    int type = 0;
    std::memcpy(&type, s.data() + 26, 4);
    IPC_EXPECT(type == 1 && s[30] == 0 && s[31] == 0 && s[32] == 0 && s[33] == 0,
               "version 3: handle type 1 (POSIX fd), then zero padding");
  }
  IPC_EXPECT(n >= 1 && s.size() == 2 + hs + 4 * n, "num_handles matches the descriptors sent");
  IPC_EXPECT(seg >= (2u << 20) && seg % (2u << 20) == 0, "segment_size is whole 2 MiB pages");
  IPC_EXPECT(sh.offset >= 0 && (size_t)sh.offset + kSize <= n * seg,
             "the block lies inside the handles' range at the offset");
  IpcHandle parsed = parse_ipc_handle(s);
  IPC_EXPECT(parsed.kind == 'e' && parsed.header.pid == pid && parsed.header.segment_size == seg &&
                 parsed.fds.size() == n,
             "parse_ipc_handle reads what shareIpcHandle wrote");
  IPC_EXPECT(a.shareIpcHandle(p).handle == s, "a second share gives the same bytes");

  // Take the descriptors as PyTorch's receiver does and map them one after another.
  long pidfd = syscall(SYS_pidfd_open, pid, 0);
  IPC_EXPECT(pidfd >= 0, std::string("pidfd_open(self): ") + std::strerror(errno));
  void* base = mmap(nullptr, n * seg, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  IPC_EXPECT(base != MAP_FAILED, "reserve the range");
  std::string failure;
  for (size_t i = 0; i < n && failure.empty(); ++i) {
    long fd = syscall(SYS_pidfd_getfd, pidfd, parsed.fds[i], 0);
    if (fd < 0) {
      failure = std::string("pidfd_getfd: ") + std::strerror(errno);
      break;
    }
    void* m = mmap(static_cast<char*>(base) + i * seg, seg, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED, (int)fd, 0);
    close((int)fd);
    if (m == MAP_FAILED)
      failure = std::string("mmap of a taken descriptor: ") + std::strerror(errno);
  }
  close((int)pidfd);
  auto* view = static_cast<unsigned char*>(base) + sh.offset;
  if (failure.empty()) {
    for (size_t i = 0; i < kSize; ++i)
      if (view[i] != (unsigned char)(i * 31 + 1)) {
        failure = "byte " + std::to_string(i) + " seen through the handle differs";
        break;
      }
  }
  if (failure.empty()) {
    for (size_t i = 0; i < kSize; i += 4096) view[i] = (unsigned char)(i * 7 + 3);
    for (size_t i = 0; i < kSize; i += 4096)
      if (p[i] != (unsigned char)(i * 7 + 3)) {
        failure = "a write through the handle is not in the block (byte " + std::to_string(i) + ")";
        break;
      }
  }
  munmap(base, n * seg);
  IPC_EXPECT(failure.empty(), failure);

  // Bad input, by name; the block stays intact.
  std::string e = thrown([&] { a.shareIpcHandle(p + 512); });
  IPC_EXPECT(e.find("not the start of a live block") != std::string::npos,
             "an interior pointer is refused by name, got: " + e);
  // Both versions' layouts, whichever this torch sends.
  std::vector<int> fds3 = {3, 4};
  std::string v2 = encode_expandable(2, 77, 2 << 20, fds3);
  std::string v3 = encode_expandable(3, 77, 2 << 20, fds3);
  IPC_EXPECT(v2.size() == 2 + 24 + 8 && v3.size() == 2 + 32 + 8, "version 2 and 3 sizes");
  for (const auto& enc : {v2, v3}) {
    IpcHandle h = parse_ipc_handle(enc);
    IPC_EXPECT(h.kind == 'e' && h.header.pid == 77 && h.header.segment_size == (2u << 20) &&
                   h.fds == fds3,
               "an encoded handle of version " + std::to_string((int)enc[0]) + " parses back");
  }
  std::string fabric2 = v2.substr(0, 26) + std::string(64 * 2, '\0');
  std::string fabric3 = v3;
  fabric3[2 + 24] = 2;  // handle_type FABRIC_HANDLE
  std::string bad_type = s;
  bad_type[1] = 'x';
  std::string zero_handles = v2.substr(0, 26);
  std::memset(&zero_handles[18], 0, 8);
  struct Case {
    std::string handle, want;
  };
  std::vector<Case> cases = {
      {"", "malformed CUDA IPC handle: 0 bytes"},
      {std::string("\x09" "e", 2), "version 9"},
      {std::string("\x04" "e", 2), "version 4"},
      {bad_type, "type byte 120"},
      {v2.substr(0, 20), "needs a 24-byte header"},
      {v3.substr(0, 30), "needs a 32-byte header"},
      {s.substr(0, s.size() - 2), "bytes after the header"},
      {zero_handles, "0 memory handles"},
      {fabric2, "fabric handles"},
      {fabric3, "fabric handles"},
      {std::string("\x02" "c", 2) + std::string(10, '\0'), "type 'c' (cudaMalloc) needs 66"},
  };
  for (const auto& c : cases) {
    std::string got = thrown([&] { a.getIpcDevPtr(c.handle); });
    IPC_EXPECT(got.find(c.want) != std::string::npos,
               "getIpcDevPtr of a malformed handle names '" + c.want + "', got: " + got);
  }
  IPC_EXPECT(parse_ipc_handle(std::string(64, '\1')).kind == 'c',
             "a bare 64-byte handle is a cudaIpcMemHandle_t (older torch)");
  IPC_EXPECT(parse_ipc_handle(std::string("\x02" "c", 2) + std::string(64, '\1')).kind == 'c',
             "a 'c' handle parses");
  for (size_t i = 0; i < kSize; i += 4096)
    IPC_EXPECT(p[i] == (unsigned char)(i * 7 + 3), "the block is intact after bad input");
  a.raw_delete(p);
  a.raw_delete(first);
#undef IPC_EXPECT
  return "";
}

}  // namespace
}  // namespace symm_torch
