// A team of threads that runs a whole decoder step inside one OpenMP parallel
// region, meeting at spin barriers between the step's operations.
//
// Why: a SmolLM2 decode step is ~300 small operations. Given to ATen's thread
// pool one by one, each is a parallel region: a futex wake of the sleeping
// worker and a join, ~20-40 us apiece on this machine, which added up to more
// than the step's arithmetic. Inside one region the members wait for each
// other by spinning on a shared counter (well under a microsecond when both
// are running), as llama.cpp's thread pool does, and the team sleeps again
// when the step is over. A member that has spun ~50-100 us sleeps on the
// futex instead: its partner has most likely lost its core to the server's
// event loop or a client, and a sleeping member lets the scheduler run the
// partner on this core rather than keep both cores busy waiting.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace protoserve {

class SpinBarrier {
 public:
  explicit SpinBarrier(int size) : size_(size) {}

  // Every member sets the same size before its first wait (a team learns its size only once running).
  void set_size(int size) { size_.store(size, std::memory_order_relaxed); }

  // Returns once all `size` members have called wait() (or the barrier was broken).
  void wait() {
    const int size = size_.load(std::memory_order_relaxed);
    if (size <= 1) return;
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      generation_.notify_all();  // a futex wake only when a member went to sleep
      return;
    }
    for (int spins = 0; spins < SPINS_BEFORE_SLEEP; ++spins) {
      if (generation_.load(std::memory_order_acquire) != generation || broken_.load(std::memory_order_relaxed)) return;
      _mm_pause();
    }
    // Still waiting: the other member is likely descheduled (the server's event loop or a client
    // took its core). Sleep on the futex, so the scheduler can run that member on this core.
    while (generation_.load(std::memory_order_acquire) == generation && !broken_.load(std::memory_order_relaxed))
      generation_.wait(generation, std::memory_order_acquire);
  }

  // A member that failed: the others stop waiting for it (their results are discarded).
  void break_() {
    broken_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);  // wake the sleepers, who then see the break
    generation_.notify_all();
  }

 private:
  // ~50-100 us of pause instructions: longer than the members' skew between operations of a
  // step, far shorter than a scheduler time slice taken from a thread that needs this core.
  static constexpr int SPINS_BEFORE_SLEEP = 2048;
  std::atomic<int> size_;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> generation_{0};
  std::atomic<bool> broken_{false};
};

// One member's view of the team: its rank, the team size and the barrier they share.
struct Team {
  int rank;
  int size;
  SpinBarrier* barrier;

  void sync() const { barrier->wait(); }

  // This member's contiguous share [begin, end) of `total` items (equal shares, the last ones short).
  void share(int64_t total, int64_t& begin, int64_t& end) const {
    const int64_t each = (total + size - 1) / size;
    begin = std::min<int64_t>(total, rank * each);
    end = std::min<int64_t>(total, begin + each);
  }
};

// fn(begin, end) over [0, total): this member's share inside a team, or split across ATen's
// threads (one parallel region) without one. Callers' results must not depend on the split.
template <typename F>
inline void for_range(const Team* team, int64_t total, int64_t grain, const F& fn) {
  if (team == nullptr) {
    at::parallel_for(0, total, grain, fn);
    return;
  }
  int64_t begin = 0, end = 0;
  team->share(total, begin, end);
  if (begin < end) fn(begin, end);
}

}  // namespace protoserve
