/* The machine's peak rate of int8 multiply-adds on the vector instruction the CPU kernels use.
 *
 * kernels/cpu/int8_dot_linear.cpp multiplies int4/int8 weight codes by int8 activation codes with
 * AVX-512 VNNI's vpdpbusd (64 multiply-adds per zmm instruction) or, on AVX2, vpmaddubsw (32 per
 * ymm instruction, summed in int16). This program issues that instruction alone, in ten
 * independent accumulator chains per thread so neither latency nor memory bounds it, on
 * OMP_NUM_THREADS threads, and prints one JSON line:
 *
 *   {"isa": "avx512_vnni", "threads": 2, "gmacs": 467.5, "seconds": 0.055}
 *
 * gmacs is the best of the repeats: the instruction's throughput bound, which no kernel that
 * also loads, unpacks and scales can pass. Built by bench/machine_peak.py with -march=native.
 *
 * usage: int8_dot_peak [instructions per thread, default 200000000] [repeats, default 5]
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define ISA "avx512_vnni"
#define MACS_PER_INSTRUCTION 64
typedef __m512i vec;
static inline vec zero(void) { return _mm512_setzero_si512(); }
static inline vec splat(char x) { return _mm512_set1_epi8(x); }
static inline vec dot(vec acc, vec a, vec b) { return _mm512_dpbusd_epi32(acc, a, b); }
static inline int32_t lanes(vec v) { return _mm512_reduce_add_epi32(v); }
#elif defined(__AVX2__)
#define ISA "avx2"
#define MACS_PER_INSTRUCTION 32
typedef __m256i vec;
static inline vec zero(void) { return _mm256_setzero_si256(); }
static inline vec splat(char x) { return _mm256_set1_epi8(x); }
/* The int4 path's form: vpmaddubsw into int16 sums (the add shares the same pipes, as it does there).
 * The product reads the chain's own accumulator: products of loop-invariant operands would be
 * computed once for all chains and hoisted. */
static inline vec dot(vec acc, vec a, vec b) {
  (void)a;
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(acc, b));
}
static inline int32_t lanes(vec v) {
  int16_t out[16];
  _mm256_storeu_si256((__m256i*)out, v);
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) s += out[i];
  return s;
}
#else
#error "needs AVX-512 VNNI or AVX2, as the CPU kernels do"
#endif

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The chains are kept in registers and opaque to the compiler, so every instruction issues. */
#define KEEP(v) __asm__ volatile("" : "+x"(v))

static int32_t run(long instructions) {
  int32_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const vec a = splat(3), b = splat(5);
    vec c0 = zero(), c1 = zero(), c2 = zero(), c3 = zero(), c4 = zero();
    vec c5 = zero(), c6 = zero(), c7 = zero(), c8 = zero(), c9 = zero();
    for (long i = 0; i < instructions / 10; ++i) {
      c0 = dot(c0, a, b); c1 = dot(c1, a, b); c2 = dot(c2, a, b); c3 = dot(c3, a, b); c4 = dot(c4, a, b);
      c5 = dot(c5, a, b); c6 = dot(c6, a, b); c7 = dot(c7, a, b); c8 = dot(c8, a, b); c9 = dot(c9, a, b);
      KEEP(c0); KEEP(c1); KEEP(c2); KEEP(c3); KEEP(c4); KEEP(c5); KEEP(c6); KEEP(c7); KEEP(c8); KEEP(c9);
    }
    total += lanes(c0) + lanes(c1) + lanes(c2) + lanes(c3) + lanes(c4);
    total += lanes(c5) + lanes(c6) + lanes(c7) + lanes(c8) + lanes(c9);
  }
  return total;
}

int main(int argc, char** argv) {
  const long instructions = argc > 1 ? atol(argv[1]) : 200000000L;
  const int repeats = argc > 2 ? atoi(argv[2]) : 5;
  if (instructions < 10 || repeats < 1) {
    fprintf(stderr, "usage: %s [instructions per thread >= 10] [repeats >= 1]\n", argv[0]);
    return 2;
  }
  const int threads = omp_get_max_threads();
  double best = 0.0;
  int32_t sink = 0;
  for (int r = 0; r < repeats; ++r) {
    const double start = now();
    sink ^= run(instructions);
    const double seconds = now() - start;
    if (best == 0.0 || seconds < best) best = seconds;
  }
  const double macs = (double)(instructions / 10 * 10) * MACS_PER_INSTRUCTION * threads;
  printf("{\"isa\": \"%s\", \"threads\": %d, \"gmacs\": %.1f, \"seconds\": %.4f, \"sink\": %d}\n", ISA, threads,
         macs / best / 1e9, best, sink & 1);
  return 0;
}
