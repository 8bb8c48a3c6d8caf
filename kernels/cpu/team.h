// A team of threads that runs a whole decoder step inside one OpenMP parallel
// region, meeting at spin barriers between the step's operations.
//
// Why: a SmolLM2 decode step is ~300 small operations. Given to ATen's thread
// pool one by one, each is a parallel region: a futex wake of the sleeping
// worker and a join, ~20-40 us apiece on this machine, which added up to more
// than the step's arithmetic. Inside one region the members wait for each
// other by spinning on a shared counter (well under a microsecond when both
// are running) and sleep again only when the step is over, as llama.cpp's
// thread pool does. A member that spins too long yields its core, so a team
// that shares the machine with the server's other threads still makes progress.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sched.h>

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
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation;) {
      if (broken_.load(std::memory_order_relaxed)) return;
      if (++spins < SPINS_BEFORE_YIELD) {
        _mm_pause();
      } else {
        sched_yield();
      }
    }
  }

  // A member that failed: the others stop waiting for it (their results are discarded).
  void break_() { broken_.store(true, std::memory_order_relaxed); }

 private:
  // ~100 us of pause instructions: far longer than any gap within a step, far shorter than a
  // scheduler time slice taken from a thread that needs this core.
  static constexpr int SPINS_BEFORE_YIELD = 4096;
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
