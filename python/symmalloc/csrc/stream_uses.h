// symmalloc's C++ allocator for PyTorch: `record_stream` as PyTorch's own allocator keeps it.
// Included by torch_allocator.cpp only.
//
// Owns: the streams each live block was recorded on (Tensor.record_stream), and the frees
// that wait for them. A block freed after record_stream is held, with an event recorded at the
// free on each of those streams, until every event has completed; only then does it go back to
// the heap. So a later allocation never gets the block's address while the recorded work may
// still use it, and never waits on those streams (no dependency between streams that the
// program did not make), as with PyTorch's allocator.
//
// Invariants:
// - A pointer is in `recorded_` only while its block is live, and in `held_` only from its
//   free until its events completed (or were waited for); never in both.
// - Nothing here places memory: the heap sees a held block's free only once it is safe.
// - While a pool route is open (a graph capture or a MemPool context: PyTorch's
//   "captures underway"), no event is queried or recorded: the caller frees at once and tells
//   the heap the recorded streams (symm_record_stream), whose placement then refuses reuse
//   across a capture, as before.
// - With nothing recorded and nothing held, the allocation and free paths pay one relaxed
//   atomic load each.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace symm_torch {

class StreamUses {
 public:
  struct Use {
    int device;
    cudaStream_t stream;
  };

  // record_stream: `p` (a live block of `device`) is also used by `stream`.
  void record(void* p, int device, cudaStream_t stream) {
    std::lock_guard<std::mutex> g(mu_);
    auto& uses = recorded_[p];
    for (const auto& u : uses)
      if (u.stream == stream) return;
    uses.push_back({device, stream});
    recorded_count_.store(recorded_.size(), std::memory_order_relaxed);
  }

  // At the free of `p`: true (and `*uses` filled) when record_stream named streams for it.
  bool take(void* p, std::vector<Use>* uses) {
    if (recorded_count_.load(std::memory_order_relaxed) == 0) return false;
    std::lock_guard<std::mutex> g(mu_);
    auto it = recorded_.find(p);
    if (it == recorded_.end()) return false;
    *uses = std::move(it->second);
    recorded_.erase(it);
    recorded_count_.store(recorded_.size(), std::memory_order_relaxed);
    return true;
  }

  // Holds `p` until the work enqueued now on every stream of `uses` has run. False (nothing
  // held, nothing left behind) when an event cannot be made or recorded, e.g. without a CUDA
  // device (the host backend): the caller then frees through the heap's own ordering.
  bool hold(void* p, const std::vector<Use>& uses) {
    std::vector<Event> events;
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;  // no CUDA device
    }
    bool ok = true;
    int cur = prev;  // cudaSetDevice only where a stream is on another device (it costs a call)
    for (const auto& u : uses) {
      if (u.device != cur) {
        if (cudaSetDevice(u.device) != cudaSuccess) {
          ok = false;
          break;
        }
        cur = u.device;
      }
      Event ev{u.device, take_event(u.device)};
      if (ev.event == nullptr) {
        ok = false;
        break;
      }
      events.push_back(ev);
      if (cudaEventRecord(ev.event, u.stream) != cudaSuccess) {
        ok = false;
        break;
      }
    }
    if (cur != prev) (void)cudaSetDevice(prev);
    if (!ok) {
      (void)cudaGetLastError();
      for (auto e : events) give_event(e);
      return false;
    }
    std::lock_guard<std::mutex> g(mu_);
    held_.push_back({p, std::move(events)});
    held_count_.store(held_.size(), std::memory_order_relaxed);
    return true;
  }

  bool any_held() const { return held_count_.load(std::memory_order_relaxed) > 0; }

  // The held blocks whose events have completed (all of them, after waiting, with `wait`),
  // removed from the held list: the caller frees them.
  std::vector<void*> ready(bool wait) {
    std::vector<void*> out;
    std::vector<Held> done;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto keep = std::stable_partition(held_.begin(), held_.end(), [&](const Held& h) {
        for (const auto& ev : h.events) {
          cudaError_t st = wait ? cudaEventSynchronize(ev.event) : cudaEventQuery(ev.event);
          if (st == cudaErrorNotReady) return true;
          if (st != cudaSuccess) (void)cudaGetLastError();  // a broken event: free anyway
        }
        return false;
      });
      done.assign(std::make_move_iterator(keep), std::make_move_iterator(held_.end()));
      held_.erase(keep, held_.end());
      held_count_.store(held_.size(), std::memory_order_relaxed);
    }
    for (auto& h : done) {
      for (const auto& ev : h.events) give_event(ev);
      out.push_back(h.ptr);
    }
    return out;
  }

 private:
  struct Event {
    int device;
    cudaEvent_t event;
  };
  struct Held {
    void* ptr;
    std::vector<Event> events;
  };

  // Events are kept for reuse (creating one costs microseconds), per device: an event belongs
  // to the device current at its creation, and is recorded only on that device's streams.
  // `device` is current when this is called.
  cudaEvent_t take_event(int device) {
    {
      std::lock_guard<std::mutex> g(events_mu_);
      auto& list = free_events_[device];
      if (!list.empty()) {
        cudaEvent_t ev = list.back();
        list.pop_back();
        return ev;
      }
    }
    cudaEvent_t ev = nullptr;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return ev;
  }

  void give_event(const Event& ev) {
    std::lock_guard<std::mutex> g(events_mu_);
    free_events_[ev.device].push_back(ev.event);
  }

  std::mutex mu_;
  std::unordered_map<void*, std::vector<Use>> recorded_;
  std::vector<Held> held_;
  std::atomic<size_t> recorded_count_{0};
  std::atomic<size_t> held_count_{0};
  std::mutex events_mu_;
  std::unordered_map<int, std::vector<cudaEvent_t>> free_events_;
};

}  // namespace symm_torch
