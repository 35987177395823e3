// symmalloc's C++ allocator for PyTorch: where the allocation path's time goes, in a build
// made for it (-DSYMM_TORCH_PROFILE; bench/step_probe.py --ext-profile builds and reads it).
// Included by torch_allocator.cpp only. In the default build every macro here is empty and
// `symm_torch_profile` reports that profiling is off.
//
// Owns: per thread, for allocations and frees, the count, the time in the allocator's method,
// the part of it inside libsymmalloc's call, and the calls over 10 us (count, time, the
// largest). Each thread's counters are written by that thread only (relaxed atomics, so a
// reader sees whole values); `symm_torch_profile` reads them all and sets them to zero. While
// `symm_torch_profile_trace` is on, each call is also kept as an event (start, duration, the
// libsymmalloc part, thread, address, size, stream), written out as CSV when it is switched
// off: the sequence a host replay runs again (bench/NOTES.md, "Global mode's host cost").
//
// Invariants:
// - Nothing here changes what the allocator does: it reads a clock around calls.
// - A thread's record lives for the process (threads that exited still report).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

namespace symm_torch {
namespace prof {

struct Op {
  std::atomic<uint64_t> n{0}, ns{0}, inner_ns{0}, slow_n{0}, slow_ns{0}, max_ns{0};
  void add(uint64_t total, uint64_t inner) {
    n.fetch_add(1, std::memory_order_relaxed);
    ns.fetch_add(total, std::memory_order_relaxed);
    inner_ns.fetch_add(inner, std::memory_order_relaxed);
    if (total > 10000) {
      slow_n.fetch_add(1, std::memory_order_relaxed);
      slow_ns.fetch_add(total, std::memory_order_relaxed);
    }
    if (total > max_ns.load(std::memory_order_relaxed)) max_ns.store(total, std::memory_order_relaxed);
  }
  std::string take(const char* name) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "\"%s\": {\"n\": %llu, \"us\": %.1f, \"inner_us\": %.1f, \"slow_n\": %llu, "
                  "\"slow_us\": %.1f, \"max_us\": %.1f}",
                  name, (unsigned long long)n.exchange(0), ns.exchange(0) / 1e3,
                  inner_ns.exchange(0) / 1e3, (unsigned long long)slow_n.exchange(0),
                  slow_ns.exchange(0) / 1e3, max_ns.exchange(0) / 1e3);
    return buf;
  }
};

struct Event {
  uint64_t t, dur, inner;
  long tid;
  char op;  // 'a' allocation, 'f' free
  uint64_t ptr, size, stream;
};

struct Thread {
  long tid = 0;
  Op alloc, free;
  std::mutex events_mu;
  std::vector<Event> events;
};

inline std::atomic<bool>& tracing() {
  static auto* on = new std::atomic<bool>(false);
  return *on;
}

inline std::mutex& mu() {
  static auto* m = new std::mutex;
  return *m;
}
inline std::vector<std::shared_ptr<Thread>>& threads() {
  static auto* v = new std::vector<std::shared_ptr<Thread>>;
  return *v;
}
inline Thread& mine() {
  thread_local std::shared_ptr<Thread> t = [] {
    auto r = std::make_shared<Thread>();
    r->tid = (long)syscall(SYS_gettid);
    std::lock_guard<std::mutex> g(mu());
    threads().push_back(r);
    return r;
  }();
  return *t;
}

inline uint64_t now_ns() {
  return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The time of one allocator method, with the libsymmalloc part noted by `inner`; the event
// while tracing (`ptr` and `size` set by the method: the size is 0 for a free).
struct Timer {
  Thread& th;
  char kind;
  uint64_t t0 = now_ns(), inner = 0, ptr = 0, size = 0, stream = 0;
  Timer(Thread& t, char k) : th(t), kind(k) {}
  ~Timer() {
    uint64_t dur = now_ns() - t0;
    (kind == 'a' ? th.alloc : th.free).add(dur, inner);
    if (tracing().load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> g(th.events_mu);
      th.events.push_back({t0, dur, inner, th.tid, kind, ptr, size, stream});
    }
  }
};
struct Inner {
  Timer& t;
  uint64_t t0 = now_ns();
  explicit Inner(Timer& tt) : t(tt) {}
  ~Inner() { t.inner += now_ns() - t0; }
};

// JSON: {"tid": {"alloc": {...}, "free": {...}}, ...}; every counter back to zero.
inline std::string take_all() {
  std::lock_guard<std::mutex> g(mu());
  std::string out = "{";
  for (size_t i = 0; i < threads().size(); i++) {
    auto& t = *threads()[i];
    if (i) out += ", ";
    out += "\"" + std::to_string(t.tid) + "\": {" + t.alloc.take("alloc") + ", " +
           t.free.take("free") + "}";
  }
  return out + "}";
}

// Tracing on (events from now) or off (every thread's events written to `path` as CSV,
// sorted by start, then dropped). 0 on success, else 1 with a message in `err`.
inline std::string trace(bool on, const char* path) {
  if (on) {
    tracing().store(true);
    return "";
  }
  tracing().store(false);
  std::vector<Event> all;
  {
    std::lock_guard<std::mutex> g(mu());
    for (auto& t : threads()) {
      std::lock_guard<std::mutex> ge(t->events_mu);
      all.insert(all.end(), t->events.begin(), t->events.end());
      t->events.clear();
    }
  }
  std::sort(all.begin(), all.end(), [](const Event& a, const Event& b) { return a.t < b.t; });
  FILE* f = path ? std::fopen(path, "w") : nullptr;
  if (!f) return std::string("cannot write the trace to ") + (path ? path : "(null)");
  std::fprintf(f, "t_ns,dur_ns,inner_ns,tid,op,ptr,size,stream\n");
  for (const auto& e : all)
    std::fprintf(f, "%llu,%llu,%llu,%ld,%c,%llu,%llu,%llu\n", (unsigned long long)e.t,
                 (unsigned long long)e.dur, (unsigned long long)e.inner, e.tid, e.op,
                 (unsigned long long)e.ptr, (unsigned long long)e.size,
                 (unsigned long long)e.stream);
  std::fclose(f);
  return "";
}

}  // namespace prof
}  // namespace symm_torch

#ifdef SYMM_TORCH_PROFILE
#define SYMM_PROF_ALLOC(p, n, s)                                        \
  symm_torch::prof::Timer symm_prof_timer(symm_torch::prof::mine(), 'a'); \
  symm_prof_timer.size = (n);                                             \
  symm_prof_timer.stream = (uint64_t)(s)
#define SYMM_PROF_FREE(p)                                                 \
  symm_torch::prof::Timer symm_prof_timer(symm_torch::prof::mine(), 'f'); \
  symm_prof_timer.ptr = (uint64_t)(p)
#define SYMM_PROF_RESULT(p) symm_prof_timer.ptr = (uint64_t)(p)
#define SYMM_PROF_INNER() symm_torch::prof::Inner symm_prof_inner(symm_prof_timer)
#else
#define SYMM_PROF_ALLOC(p, n, s)
#define SYMM_PROF_FREE(p)
#define SYMM_PROF_RESULT(p)
#define SYMM_PROF_INNER()
#endif
