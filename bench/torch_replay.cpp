// A training step's allocations and frees, replayed through whichever allocator PyTorch uses
// (its own, or symmalloc's after install_global()), with their threads: the sequence
// bench/step_probe.py --ext-trace recorded (CSV t_ns,dur_ns,inner_ns,tid,op,ptr,size,stream).
// Built and driven by bench/torch_replay.py; the same replay on host memory through the heap
// alone is bench/step_replay.rs.
//
// One std::thread per recorded thread; every thread walks the sequence and runs its own events
// when the one before has finished (spinning between), calling
// CUDACachingAllocator::raw_alloc_with_stream / raw_delete and timing the call alone. Blocks
// allocated before the recording began are not freed; those still live at the end of a
// repetition are freed then by the first thread, untimed. The first `warmup` repetitions (at
// least 1) are not timed.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

struct Event {
  long tid;
  bool alloc;
  uint64_t ptr, size, stream;
  long alloc_of = -1;  // a free: the event that allocated its block (-1: before the recording)
};

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[(size_t)((v.size() - 1) * p + 0.5)];
}

}  // namespace

extern "C" int torch_replay(const char* csv, int reps, int warmup, char* out, size_t len) {
  warmup = std::max(warmup, 1);
  if (reps <= warmup) return std::snprintf(out, len, "reps %d must exceed warmup %d", reps, warmup), 1;
  std::ifstream in(csv);
  if (!in) return std::snprintf(out, len, "cannot read %s", csv), 1;
  std::string line;
  std::getline(in, line);  // header
  std::vector<Event> ev;
  std::unordered_map<uint64_t, long> at;
  while (std::getline(in, line)) {
    std::stringstream ss(line);
    std::string f[8];
    for (auto& x : f) std::getline(ss, x, ',');
    Event e{std::stol(f[3]), f[4] == "a", std::stoull(f[5]), std::stoull(f[6]),
            std::stoull(f[7])};
    if (e.alloc) {
      at[e.ptr] = (long)ev.size();
    } else {
      auto it = at.find(e.ptr);
      if (it != at.end()) {
        e.alloc_of = it->second;
        at.erase(it);
      }
    }
    ev.push_back(e);
  }
  std::vector<long> left;
  for (auto& kv : at) left.push_back(kv.second);
  std::vector<long> tids;
  for (auto& e : ev)
    if (std::find(tids.begin(), tids.end(), e.tid) == tids.end()) tids.push_back(e.tid);
  std::sort(tids.begin(), tids.end());

  auto* alloc = c10::cuda::CUDACachingAllocator::get();
  int device = c10::cuda::current_device();
  std::atomic<size_t> next{0};
  std::vector<void*> addr(ev.size(), nullptr);
  const size_t n = ev.size() + 1;
  // per thread: (alloc?, seconds)
  std::vector<std::vector<std::pair<bool, double>>> times(tids.size());
  std::vector<std::thread> threads;
  for (size_t k = 0; k < tids.size(); k++) {
    threads.emplace_back([&, k] {
      (void)cudaSetDevice(device);
      long tid = tids[k];
      for (int rep = 0; rep < reps; rep++) {
        auto wait = [&](size_t i) {
          while (next.load(std::memory_order_acquire) != rep * n + i) {
          }
        };
        for (size_t i = 0; i < ev.size(); i++) {
          const Event& e = ev[i];
          if (e.tid != tid) continue;
          wait(i);
          if (e.alloc) {
            auto t0 = std::chrono::steady_clock::now();
            void* p = alloc->raw_alloc_with_stream(e.size, (cudaStream_t)e.stream);
            auto t1 = std::chrono::steady_clock::now();
            if (rep >= warmup) times[k].push_back({true, std::chrono::duration<double>(t1 - t0).count()});
            addr[i] = p;
          } else if (e.alloc_of >= 0) {
            void* p = addr[e.alloc_of];
            auto t0 = std::chrono::steady_clock::now();
            alloc->raw_delete(p);
            auto t1 = std::chrono::steady_clock::now();
            if (rep >= warmup) times[k].push_back({false, std::chrono::duration<double>(t1 - t0).count()});
          }
          next.store(rep * n + i + 1, std::memory_order_release);
        }
        if (k == 0) {
          wait(n - 1);
          for (long j : left) alloc->raw_delete(addr[j]);
          next.store((rep + 1) * n, std::memory_order_release);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  std::string r = "{";
  double timed = reps - warmup;
  for (size_t k = 0; k < tids.size(); k++) {
    for (bool a : {true, false}) {
      std::vector<double> v;
      for (auto& [isa, s] : times[k])
        if (isa == a) v.push_back(s * 1e6);
      double total = 0;
      for (double x : v) total += x;
      char buf[400];
      std::snprintf(buf, sizeof buf,
                    "%s\"%ld %s\": {\"calls_per_rep\": %.0f, \"us_per_rep\": %.1f, \"mean_us\": "
                    "%.3f, \"p50_us\": %.3f, \"p99_us\": %.3f, \"max_us\": %.1f}",
                    r.size() > 1 ? ", " : "", tids[k], a ? "alloc" : "free", v.size() / timed,
                    total / timed, v.empty() ? 0 : total / v.size(), pct(v, 0.5), pct(v, 0.99),
                    v.empty() ? 0 : *std::max_element(v.begin(), v.end()));
      r += buf;
    }
  }
  r += "}";
  std::snprintf(out, len, "%s", r.c_str());
  return 0;
}
