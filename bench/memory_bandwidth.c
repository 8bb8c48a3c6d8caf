/* The machine's memory read bandwidth, the ceiling of single-stream decode.
 *
 * A decode step of one sequence reads every weight of the model once from memory (they do not fit
 * in the caches between steps), so tokens/s cannot pass bandwidth / bytes per token. This program
 * reads a buffer far larger than the last-level cache front to back on OMP_NUM_THREADS threads
 * (each its own contiguous share, eight independent xor chains so nothing but memory bounds it)
 * and prints one JSON line, the best of the repeats:
 *
 *   {"threads": 2, "gbps": 41.6, "bytes": 1073741824}
 *
 * Built by bench/memory_bandwidth.py with -O3 -march=native (the compiler vectorizes the chains).
 *
 * usage: memory_bandwidth [bytes, default 1 GiB] [repeats, default 5]
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const size_t bytes = argc > 1 ? (size_t)atoll(argv[1]) : ((size_t)1 << 30);
  const int repeats = argc > 2 ? atoi(argv[2]) : 5;
  if (bytes < ((size_t)1 << 20) || repeats < 1) {
    fprintf(stderr, "usage: %s [bytes >= 1 MiB] [repeats >= 1]\n", argv[0]);
    return 2;
  }
  const size_t words = bytes / sizeof(uint64_t) / 64 * 64;
  uint64_t* buf = aligned_alloc(4096, words * sizeof(uint64_t));
  if (buf == NULL) {
    fprintf(stderr, "cannot allocate %zu bytes\n", bytes);
    return 1;
  }
  int threads = 1;
#pragma omp parallel
  {
    /* first touch by the thread that reads the share (and every page mapped before timing) */
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    const size_t each = words / n / 64 * 64, begin = t * each, end = t == n - 1 ? words : begin + each;
    for (size_t i = begin; i < end; ++i) buf[i] = i * 0x9E3779B97F4A7C15ull;
#pragma omp single
    threads = n;
  }
  double best = 1e30;
  uint64_t sink = 0;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = now();
#pragma omp parallel reduction(^ : sink)
    {
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      const size_t each = words / n / 64 * 64, begin = t * each, end = t == n - 1 ? words : begin + each;
      uint64_t a[8] = {0};
      for (size_t i = begin; i < end; i += 8)
        for (int k = 0; k < 8; ++k) a[k] ^= buf[i + k];
      for (int k = 0; k < 8; ++k) sink ^= a[k];
    }
    const double dt = now() - t0;
    if (dt < best) best = dt;
  }
  printf("{\"threads\": %d, \"gbps\": %.1f, \"bytes\": %zu, \"sink\": %d}\n", threads,
         words * sizeof(uint64_t) / best / 1e9, words * sizeof(uint64_t), (int)(sink & 1));
  free(buf);
  return 0;
}
