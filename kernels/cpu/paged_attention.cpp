// Causal attention of a flattened batch over the paged KV cache, for the CPU.
//
// One kernel for both engine modes: it is fast (AVX-512 or AVX2, no gather of the
// context into new tensors) and batch-invariant by construction.
//
// Layout: q [T, H, D] float32 (rows may be strided); k/v cache [num_blocks, block_size, KVH, D] float32
// or bfloat16, or [num_blocks, block_size, KVH, D + 4] int8 (each head's row: D codes, then their float32
// scale; see "int8 rows" below); sequence b owns query rows query_start_loc[b]..query_start_loc[b+1]
// and, after this step, a context of seq_lens[b] tokens whose K/V the caller has
// already written. Its query row i sits at position p = seq_lens[b] - n_b + i
// and sees key j iff j <= p and (no window or j > p - window). Query head h reads
// KV head h / (H / KVH).
//
// Work unit = a tile of up to QUERY_TILE consecutive queries of one sequence and one
// KV head: the GQA group's query heads and the tile's queries share every K/V row
// loaded. Each query walks exactly its own visible keys in ascending order, in key
// blocks of KEY_BLOCK = 64 positions aligned to position 0 (the same blocks whatever
// the cache's block size), with an online softmax:
//
//   scores  s_u = tree_sum_l( chain_c q[16c+l] * k_u[16c+l] )   (fixed tree below; bfloat16
//           pools with vdpbf16ps: one chain over the pairs instead, see column_scores)
//   m'      = max(m, max_u s_u)                                  (exact)
//   p_u     = exp(s_u - m')  for visible u, exactly 0 otherwise
//   l       = l * exp(m - m') + ((p_0..15 + p_16..31) + (p_32..47 + p_48..63))
//                                               (16 lanes, summed once at the end)
//   acc     = acc * exp(m - m') + sum_u p_u v_u  (one FMA chain per lane, ascending u)
//
// A block's scores are four vectors of 16 keys; the step's fixed costs (the max across lanes, the
// rescale of acc, the bookkeeping) are paid once per 64 keys.
//
// Decodes of different sequences whose block tables hold the same cache blocks from a partition's
// start (a prompt prefix in the prefix cache) form a tile too, over those shared key blocks
// (share_prefix_blocks); each query then walks the rest of its partition alone, from its own state.
//
// Long contexts: the keys are cut into partitions of PARTITION positions aligned to position 0. A
// query runs the walk above from a fresh state (m = -inf, l = 0, acc = 0) in each partition its keys
// reach, and the partitions' states are folded in ascending order:
//
//   M = max(m_f, m_p);  l_f = l_p * exp(m_p - M) + l_f * exp(m_f - M);  the same for acc
//
// (a partition the query sees nothing of is skipped; the first one seen is taken as it is, so a
// query within one partition gets exactly the single walk's bits). A partition's state depends on
// nothing but the query and its keys, so the partitions of one stream's decode can run on different
// threads (split-K, as GPU flash-decoding does: one sequence's decode spreads over every thread and
// reads whole cached rows, all KV heads side by side), or in turn on one thread (prefill): the same
// bits either way.
//
// Batch invariance: every one of those operations is a function of the query's
// own q vector, its position and its sequence's cached K/V only. Which other
// tokens are in the batch decides only which units exist and which thread runs
// them (units are handed out dynamically) and which queries share a tile, never a
// query's arithmetic: the same code path runs for T = 1 or T = 4096, a score lane
// never mixes with another lane, a query's state is its own, and no key block or
// key outside the query's range enters it. So a token's output is bit-identical
// alone, in any batch, in a prompt chunk of any size and on any thread count. (The vector path for D % 16 == 0 and the scalar
// path for other D give different bits, but the path depends only on D.)
//
// Build flags (kernels/cpu/extension.py) include -ffp-contract=off, so the only
// fused multiply-adds are the explicit simd::fmadd / fnmadd below.

#include "kernels.h"
#include "simd.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>  // _mm_prefetch

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace simd = protoserve::simd;
using simd::F16;

// bfloat16 pools on CPUs with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids) multiply in
// bfloat16 with vdpbf16ps, straight from the cached rows: scores against the scaled query rounded
// to bfloat16 once (from the key block transposed once per tile and KV head), P @ V with each
// block's probabilities rounded to bfloat16.
#if defined(PROTOSERVE_SIMD_BF16)
constexpr bool BF16_ATTENTION = true;
#else
constexpr bool BF16_ATTENTION = false;
#endif
// int8 pools on those CPUs (all of which have AVX512-VNNI) multiply in int16 with vpdpwssd: the cached
// codes widened exactly, against the query and the block's probabilities quantized to 15 bits.
#if defined(PROTOSERVE_SIMD_BF16) && defined(__AVX512VNNI__)
constexpr bool INT16_ATTENTION = true;
#else
constexpr bool INT16_ATTENTION = false;
#endif

namespace {

constexpr int LANES = 16;      // floats per vector (simd.h)
constexpr int SUBS = 4;        // vectors of scores per key block
constexpr int KEY_BLOCK = SUBS * LANES;  // keys per online-softmax step
static_assert(SUBS == 4, "the sums of a block's four score vectors are written out as trees");
// Consecutive queries of a sequence sharing each loaded K/V block (and, for bfloat16 products, each
// block's transposed keys and interleaved values): a long tile spreads a block's transpose over more
// queries (docs/notes/performance-log.md has the measurements).
constexpr int QUERY_TILE = 32;
constexpr int PARTITION = 256;  // key positions per partition (a multiple of KEY_BLOCK)
// P @ V register tile: query heads x 16-column chunks of accumulators kept in registers (16 of
// AVX-512's 32 zmm; 8 of AVX2's 16 ymm, each vector being two of them).
#if defined(PROTOSERVE_SIMD_AVX512)
constexpr int PV_HEADS = 4, PV_COLUMNS = 4;
#else
constexpr int PV_HEADS = 2, PV_COLUMNS = 2;
#endif
// Below this many (query head x visible key x head_dim) multiply-adds in a call, the
// OpenMP fork/join costs more than it saves; the result is the same either way.
constexpr int64_t MIN_PARALLEL_WORK = 1 << 17;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
// exp(x) below this is flushed to exactly 0 (exp(-87) is still a normal float), so
// the accumulators never see denormals.
constexpr float EXP_MIN = -87.0f;

struct Problem {
  const float* q;                // [T, H, D], rows q_stride floats apart
  int64_t q_stride;
  const void* k;                 // [num_slots, KVH, kv_row] (float, uint16 bfloat16 bits or int8 rows)
  const void* v;
  const int32_t* block_tables;   // [B, max_blocks]
  int64_t max_blocks;
  float* out;                    // [T, H, D]
  int64_t num_tokens;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int kv_row;                    // pool elements per KV head of a slot: head_dim, or head_dim + 4 for int8
  int group;                     // query heads per KV head
  int block_size;                // cache block size (slots per block)
  float scale;
  int window;                    // 0 = none
};

// ---- float32 / bfloat16 loads -------------------------------------------------------------

inline F16 load16(const float* p) { return simd::load(p); }

inline F16 load16(const uint16_t* p) { return simd::load_bf16(p); }

inline float load1(const float* p) { return *p; }

inline float load1(const uint16_t* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ---- int8 rows ----------------------------------------------------------------------------

// An int8 pool keeps each (token, KV head) row as D codes and then, in the next 4 bytes, the row's
// float32 scale, as GGUF's q8_0 keeps a block's scale beside its codes (llama.cpp's `-ctk q8_0`):
// scale = max|x| / 127, code = round(x * 127 / max|x|) in -127..127, value = code * scale. Half a bfloat16
// row's bytes (D + 4 against 2D), which a long context's decode streams every step.
constexpr int INT8_SCALE_BYTES = 4;

inline float int8_row_scale(const int8_t* row, int D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

// The row's values code * scale (one float32 rounding), for the float32 walk (CPUs without AVX512-VNNI,
// head sizes not held in registers).
inline void widen_int8_row(const int8_t* row, int D, float* out) {
  const F16 s = simd::set1(int8_row_scale(row, D));
  for (int d = 0; d < D; d += LANES) simd::store(out + d, simd::mul(simd::to_float(simd::load_i8_as_i32(row + d)), s));
}

// Register-held head sizes of pairs: 32 values (a 512-bit vector of 16-bit pairs) at a time.
template <int CH>
constexpr bool pair_head_dim = CH >= 2 && CH % 2 == 0;

// bfloat16 rows multiply in bfloat16 (scores and P @ V by vdpbf16ps) ...
template <typename KT, int CH>
constexpr bool uses_bf16_products = BF16_ATTENTION && std::is_same_v<KT, uint16_t> && pair_head_dim<CH>;

// ... and int8 rows in int16 (vpdpwssd, see "int16 products" below): the same pair walk.
template <typename KT, int CH>
constexpr bool uses_int16_products = INT16_ATTENTION && std::is_same_v<KT, int8_t> && pair_head_dim<CH>;

template <typename KT, int CH>
constexpr bool uses_pair_products = uses_bf16_products<KT, CH> || uses_int16_products<KT, CH>;

// The element type the walk reads a pool's rows as: the pool's own, or for an int8 pool without int16
// products its rows widened to float32 once per key block and KV head into the thread's scratch.
template <typename PT, int CH>
using row_t = std::conditional_t<!std::is_same_v<PT, int8_t> || uses_int16_products<PT, CH>, PT, float>;

// ---- exp --------------------------------------------------------------------------------

// exp(x) for x <= 0 (Cephes expf polynomial: ~1 ulp on the range), flushed to exactly 0
// below EXP_MIN and for lanes outside `keep`.
inline F16 exp_nonpositive(F16 x, simd::Mask keep) {
  keep &= simd::greater_equal(x, simd::set1(EXP_MIN));
  x = simd::max(x, simd::set1(EXP_MIN));  // also turns -inf (masked lanes) finite
  const F16 n = simd::round(simd::mul(x, simd::set1(1.44269504088896341f)));  // >= -126: 2^n is normal
  F16 r = simd::fnmadd(n, simd::set1(0.693359375f), x);
  r = simd::fnmadd(n, simd::set1(-2.12194440e-4f), r);
  F16 y = simd::set1(1.9875691500e-4f);
  y = simd::fmadd(y, r, simd::set1(1.3981999507e-3f));
  y = simd::fmadd(y, r, simd::set1(8.3334519073e-3f));
  y = simd::fmadd(y, r, simd::set1(4.1665795894e-2f));
  y = simd::fmadd(y, r, simd::set1(1.6666665459e-1f));
  y = simd::fmadd(y, r, simd::set1(5.0000001201e-1f));
  y = simd::fmadd(y, simd::mul(r, r), simd::add(r, simd::set1(1.0f)));
  return simd::keep(keep, simd::scale_pow2(y, n));
}

// ---- rows asked for ahead ----------------------------------------------------------------

// The cached rows a thread reads next (one KV head's K rows, then its V rows), asked for into L1 while
// the current head computes: a sequence's blocks are scattered, so the hardware prefetcher cannot guess
// them, and decode reads every row from beyond L2. The rows are the next KV head's of the current key
// block, or the first head's of the next block: a 64-key block of SmolLM2's three KV heads is 48 KB of
// K and V, an L1's worth, so asking for the whole next block while this one computes evicts lines
// before they are read. They are asked for a row at a time, from inside the scores' and P @ V's loops
// and in eighths between the head's steps: a prefetch waits to issue while the core's L1 miss buffers
// are full, and nothing behind it runs meanwhile, so a burst of 32 lines or more stalls the work. A row
// costs a few instructions (its byte offset is computed once per block), which matters: decode runs
// ~250 of them per block and head beside ~2,500 instructions of arithmetic.
class RowsAhead {
 public:
  // offsets: the rows' byte offsets from k and from v; lines: 64-byte lines per row (row_lines);
  // every: one row per `every` steps (1 or 2).
  RowsAhead(const void* k, const void* v, const int64_t* offsets, int rows, int lines, int every)
      : base_(static_cast<const char*>(k)), v_(static_cast<const char*>(v)), offsets_(offsets), rows_(rows),
        lines_(lines), skip_(every - 1), left_(2 * rows) {}
  int left() const { return left_; }
  __attribute__((always_inline)) void step() {
    if ((++tick_ & skip_) == 0) issue(1);
  }
  __attribute__((always_inline)) void issue(int rows) {
    for (; rows > 0 && left_ > 0; --rows, --left_) {
      const char* row = base_ + offsets_[u_];
      for (int l = 0; l < lines_; ++l) _mm_prefetch(row + 64 * l, _MM_HINT_T0);
      if (++u_ == rows_) u_ = 0, base_ = v_;
    }
  }

 private:
  const char* base_;
  const char* v_;
  const int64_t* offsets_;
  int rows_, lines_, skip_, left_;
  int u_ = 0, tick_ = 0;
};

// The 64-byte lines holding a row of row_bytes whatever its offset: rows are row_bytes apart in the
// pool, so a row's offset in its line is a multiple of row_bytes' largest power-of-two factor (<= 64).
constexpr int row_lines(int row_bytes) {
  const int align = std::min(row_bytes & -row_bytes, 64);
  return (row_bytes + (64 - align) + 63) / 64;
}

// Steps per row asked for: one row per step of the scores' and P @ V's inner loops for a lone query
// (decode), whose loops take few steps a head; one per two steps for a tile of queries (prefill), whose
// many steps would otherwise ask for the next head's rows long before they are read and push the tile's
// transposed keys and interleaved values out of L1.
constexpr int steps_per_row(int tile_queries) { return tile_queries == 1 ? 1 : 2; }

// One KV head's cached rows of a key block, as the pair walks read them: the head's base plus each key's
// byte offset in the pool (computed once per block, lanes no query sees pointing at a readable row).
template <typename KT>
struct RowsView {
  const char* base;
  const int64_t* offsets;
  __attribute__((always_inline)) const KT* operator[](int u) const {
    return reinterpret_cast<const KT*>(base + offsets[u]);
  }
};

// ---- scores -----------------------------------------------------------------------------

// Scores of one (pre-scaled) query head against the block's 16 key rows (float32).
// Lane l of key u's partial is one multiply-add chain over q[16c + l] * k_u[16c + l],
// c ascending; rows of invisible keys point at a visible row and are masked later.
// CH > 0: head_dim = 16 * CH known at compile time, the query kept in registers;
// CH == 0: any multiple of 16. Both compute the same chains.
template <int CH>
__attribute__((always_inline)) inline F16 block_scores(const float* q, const float* const krow[16], int chunks) {
  simd::LaneSums16 sums;
  if constexpr (CH > 0) {
    F16 qc[CH];
#pragma GCC unroll 8
    for (int c = 0; c < CH; ++c) qc[c] = simd::load(q + c * LANES);
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) {
      const float* k = krow[u];
      F16 acc = simd::mul(qc[0], simd::load(k));
#pragma GCC unroll 8
      for (int c = 1; c < CH; ++c) acc = simd::fmadd(qc[c], simd::load(k + c * LANES), acc);
      sums.put(u, acc);
    }
  } else {
    F16 part[16];
    F16 qc = simd::load(q);
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) part[u] = simd::mul(qc, simd::load(krow[u]));
    for (int c = 1; c < chunks; ++c) {
      qc = simd::load(q + c * LANES);
#pragma GCC unroll 16
      for (int u = 0; u < 16; ++u) part[u] = simd::fmadd(qc, simd::load(krow[u] + c * LANES), part[u]);
    }
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) sums.put(u, part[u]);
  }
  return sums.result();
}

#if defined(PROTOSERVE_SIMD_BF16)
// bfloat16 scores in column form. Each 16 key rows of the block (bfloat16, as cached) are transposed
// once per tile, block and KV head: kt[s * D/2 + d] holds in lane u the pair (2d, 2d+1) of key
// 16s + u's row. A query head's 64 scores are then four vectors: lane u of vector s is one chain over
// d ascending of
//   vdpbf16ps(q[2d] k_{16s+u}[2d] + q[2d+1] k_{16s+u}[2d+1])
// with the query's pair d broadcast. A small GEMM micro-kernel: R query heads x 4 vectors of keys, each
// broadcast pair serving four vdpbf16ps and each loaded kt serving R, no horizontal sums; R x 4
// independent chains hide vdpbf16ps's latency even for decode's group of 3. Which heads share a
// kernel call changes nothing in a head's lanes.
//
// int16 products (int8 pools): the same walk over int16 pairs, one vpdpwssd where vdpbf16ps was. The
// key codes widen exactly to int16; the scaled query is quantized per (query, head) to int16 codes
// round(q * 32767 / max|q|) (quantize_query), so a score is the exact integer sum times that
// query's scale times the key's row scale. |sum| <= D * 32767 * 127 < 2^31 for D <= 256.
typedef uint32_t u32_alias __attribute__((may_alias));

// The 16-bit pair at p in every lane.
__attribute__((always_inline)) inline __m512i broadcast_pair(const uint16_t* p) {
  return _mm512_set1_epi32(static_cast<int>(*reinterpret_cast<const u32_alias*>(p)));
}

// 32 consecutive values of a cached row as 16-bit lanes: bfloat16 as cached, int8 codes widened to int16.
__attribute__((always_inline)) inline __m512i load_pairs(const uint16_t* p) { return _mm512_loadu_si512(p); }
__attribute__((always_inline)) inline __m512i load_pairs(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc + the pairs' products: float32 lanes (bfloat16 pairs) or int32 lanes held in an F16 (int16 pairs).
template <bool INT16>
__attribute__((always_inline)) inline F16 dot_pairs(F16 acc, __m512i a, __m512i b) {
  if constexpr (INT16) return _mm512_castsi512_ps(_mm512_dpwssd_epi32(_mm512_castps_si512(acc), a, b));
  else return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// out[d] lane u = in[u] dword d, for a 16 x 16 block of dwords.
__attribute__((always_inline)) inline void transpose16x16(const __m512i in[16], __m512i* out) {
  __m512i a[16], b[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // lane L of a[2i], a[2i+1]: rows 2i, 2i+1 at dwords 4L+0,1 / 4L+2,3
    a[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // lane L of b[4i+e]: rows 4i..4i+3 at dword 4L+e
    b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
#pragma GCC unroll 4
  for (int e = 0; e < 4; ++e) {  // out[4L+e] lane-chunk i = b[4i+e] chunk L: a 4 x 4 transpose of 128-bit chunks
    const __m512i x0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44), x1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44), x3 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
    _mm512_store_si512(out + e, _mm512_shuffle_i32x4(x0, x2, 0x88));
    _mm512_store_si512(out + 4 + e, _mm512_shuffle_i32x4(x0, x2, 0xDD));
    _mm512_store_si512(out + 8 + e, _mm512_shuffle_i32x4(x1, x3, 0x88));
    _mm512_store_si512(out + 12 + e, _mm512_shuffle_i32x4(x1, x3, 0xDD));
  }
}

// kt (SUBS * P2 vectors, P2 = D / 2) from the block's KEY_BLOCK rows (bfloat16 or int8).
template <int P2, typename KT>
inline void transpose_keys(const RowsView<KT>& krow, __m512i* kt) {
  for (int sub = 0; sub < SUBS; ++sub)
    for (int c = 0; c < P2 / 16; ++c) {
      __m512i rows[16];
#pragma GCC unroll 16
      for (int u = 0; u < 16; ++u) rows[u] = load_pairs(krow[sub * LANES + u] + 32 * c);
      transpose16x16(rows, kt + sub * P2 + 16 * c);
    }
}

// The KEY_BLOCK scores of R query heads (bfloat16 or int16 pairs at q[r]) against the transposed block:
// out[r * SUBS + s] holds keys 16s .. 16s + 15 (int16: the integer sums, in int32 lanes).
template <int R, int P2, bool INT16>
__attribute__((always_inline)) inline void column_scores(const __m512i* kt, const uint16_t* const q[R], F16* out,
                                                         RowsAhead& ahead) {
  F16 acc[R][SUBS];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int sub = 0; sub < SUBS; ++sub) acc[r][sub] = simd::zero();
#pragma GCC unroll 64
  for (int d = 0; d < P2; ++d) {
    ahead.step();
    __m512i kd[SUBS];
#pragma GCC unroll 4
    for (int sub = 0; sub < SUBS; ++sub) kd[sub] = _mm512_load_si512(kt + sub * P2 + d);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i qd = broadcast_pair(q[r] + 2 * d);
#pragma GCC unroll 4
      for (int sub = 0; sub < SUBS; ++sub) acc[r][sub] = dot_pairs<INT16>(acc[r][sub], kd[sub], qd);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int sub = 0; sub < SUBS; ++sub) out[r * SUBS + sub] = acc[r][sub];
}

constexpr int SCORE_HEADS = 6;  // query heads per column_scores call: 24 accumulators

template <int P2, bool INT16>
inline void column_scores_n(int n, const __m512i* kt, const uint16_t* const q[SCORE_HEADS], F16* out,
                            RowsAhead& ahead) {
  switch (n) {
    case 1: column_scores<1, P2, INT16>(kt, q, out, ahead); break;
    case 2: column_scores<2, P2, INT16>(kt, q, out, ahead); break;
    case 3: column_scores<3, P2, INT16>(kt, q, out, ahead); break;
    case 4: column_scores<4, P2, INT16>(kt, q, out, ahead); break;
    case 5: column_scores<5, P2, INT16>(kt, q, out, ahead); break;
    default: column_scores<6, P2, INT16>(kt, q, out, ahead); break;
  }
}

// The scaled query row's int16 codes round(q * 32767 / max|q|) into codes (D values); returns their scale
// max|q| / 32767 (0 for a zero row, its codes 0).
inline float quantize_query(const float* q, int D, uint16_t* codes) {
  F16 m = simd::zero();
  for (int d = 0; d < D; d += LANES) m = simd::max(m, simd::abs(simd::load(q + d)));
  const float amax = simd::reduce_max(m);
  const F16 inv = simd::set1(amax == 0.0f ? 0.0f : 32767.0f / amax);
  for (int d = 0; d < D; d += LANES)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + d),
                        _mm512_cvtepi32_epi16(simd::to_int(simd::mul(simd::load(q + d), inv))));
  return amax / 32767.0f;
}
#endif

// ---- P @ V ------------------------------------------------------------------------------

// acc[g] = acc[g] * corr[g] + sum_{u=ua..ub} p[g][u] * v_u for G heads of the group and CC
// 16-column vectors starting at column chunk c0: each loaded V vector serves the G heads.
// Per lane this is one FMA chain in ascending u whatever G and CC are.
template <typename KT, int G, int CC>
void pv_tile(float* acc, int head_dim, const float* probs, const float* corr, const KT* const vrow[KEY_BLOCK],
             int ua, int ub, int c0, RowsAhead& ahead) {
  F16 a[G][CC];
  for (int g = 0; g < G; ++g) {
    const F16 cg = simd::set1(corr[g]);
    for (int c = 0; c < CC; ++c) a[g][c] = simd::mul(simd::load(acc + g * head_dim + (c0 + c) * LANES), cg);
  }
  for (int u = ua; u <= ub; ++u) {
    ahead.step();
    F16 vc[CC];
    for (int c = 0; c < CC; ++c) vc[c] = load16(vrow[u] + (c0 + c) * LANES);
    for (int g = 0; g < G; ++g) {
      const F16 pu = simd::set1(probs[g * KEY_BLOCK + u]);
      for (int c = 0; c < CC; ++c) a[g][c] = simd::fmadd(pu, vc[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CC; ++c) simd::store(acc + g * head_dim + (c0 + c) * LANES, a[g][c]);
}

template <typename KT>
using PvFn = void (*)(float*, int, const float*, const float*, const KT* const*, int, int, int, RowsAhead&);

template <typename KT, int G>
constexpr PvFn<KT> pv_for_cc(int cc) {
  return cc == 1   ? &pv_tile<KT, G, 1>
         : cc == 2 ? &pv_tile<KT, G, 2>
         : cc == 3 ? &pv_tile<KT, G, 3>
                   : &pv_tile<KT, G, 4>;
}

template <typename KT>
PvFn<KT> pv_kernel(int g, int cc) {
  switch (g) {
    case 1: return pv_for_cc<KT, 1>(cc);
    case 2: return pv_for_cc<KT, 2>(cc);
    case 3: return pv_for_cc<KT, 3>(cc);
    default: return pv_for_cc<KT, 4>(cc);
  }
}

// ---- one unit -----------------------------------------------------------------------------

// A run of consecutive query rows of one sequence, attended together for one KV head so
// that each K/V block is brought into L1 once for all of them. Every query still walks
// only its own key range with its own state: the tile decides what is cached, not what
// is computed.
using Tile = protoserve::AttentionTile;

// Scratch of one thread, reused across its units and calls (thread_local: no allocation
// once a thread has seen the largest shapes).
struct Scratch {
  // Per query of the tile, per query head of the unit (its KV heads' groups):
  std::vector<float> q;      // [QUERY_TILE, heads, D] scaled queries
  std::vector<uint16_t> qb;  // [QUERY_TILE, heads, D] the same in bfloat16 (bf16 scores) or int16 codes (int16 scores)
  std::vector<float> qscale;  // [QUERY_TILE, heads] the int16 codes' scales
  std::vector<float> acc;    // [QUERY_TILE, heads, D] running sum of p * v
  std::vector<float> m;      // [QUERY_TILE, heads] running max
  std::vector<F16> l;        // [QUERY_TILE, heads] running sum of p, per lane
  std::vector<float> probs;  // [QUERY_TILE, heads, KEY_BLOCK] this block's scores, then probabilities
  std::vector<float> corr;   // [QUERY_TILE, heads] this block's rescale factors
  std::vector<float> kbuf;   // [KEY_BLOCK, D] the block's K rows widened to float32 (bfloat16 or int8 cache)
  std::vector<float> vbuf;   // [KEY_BLOCK, D] its V rows widened to float32 (int8 cache)
  std::vector<F16> kt;       // [SUBS * D / 2] pair products: the block's K rows transposed (transpose_keys)
  std::vector<F16> vp;       // [KEY_BLOCK * D / 32] pair products: the block's V pairs interleaved (unpack_values)
  // The fold of the partitions done so far, laid out as acc / m / l.
  std::vector<float> facc;
  std::vector<float> fm;
  std::vector<F16> fl;
  // A shared tile's states, held while each of its queries walks the rest of its partition.
  std::vector<float> hacc;
  std::vector<float> hm;
  std::vector<F16> hl;

  void fit(const Problem& pb) {  // room for a unit of every KV head
    const size_t gd = static_cast<size_t>(QUERY_TILE) * pb.num_heads * pb.head_dim, g = QUERY_TILE * pb.num_heads;
    grow(q, gd);
    grow(qb, gd);
    grow(qscale, g);
    grow(acc, gd);
    grow(m, g);
    grow(l, g);
    grow(probs, g * KEY_BLOCK);
    grow(corr, g);
    for (auto* rows : {&kbuf, &vbuf}) grow(*rows, static_cast<size_t>(KEY_BLOCK) * pb.head_dim);
    grow(kt, static_cast<size_t>(SUBS * pb.head_dim / 2));
    grow(vp, static_cast<size_t>(KEY_BLOCK * pb.head_dim / 32));
    grow(facc, gd);
    grow(fm, g);
    grow(fl, g);
    grow(hacc, gd);
    grow(hm, g);
    grow(hl, g);
  }

 private:
  template <typename V>
  static void grow(V& v, size_t n) {
    if (v.size() < n) v.resize(n);
  }
};

inline int first_key(const Problem& pb, int pos) { return pb.window > 0 ? std::max(0, pos - pb.window + 1) : 0; }

// Keys a walk covers: the whole range (part < 0) or one partition's.
struct KeyRange {
  int lo, hi;
  static KeyRange of_part(int part) {
    return part < 0 ? KeyRange{0, std::numeric_limits<int>::max()} : KeyRange{part * PARTITION, part * PARTITION + PARTITION - 1};
  }
};

// Slot (row of the flattened cache) of positions j0+ua .. j0+ub of sequence `table`.
inline void block_slots(const Problem& pb, const int32_t* table, int j0, int ua, int ub, int64_t slots[KEY_BLOCK]) {
  const int bs = pb.block_size;
  int j = j0 + ua;
  int blk = j / bs, off = j % bs;
  for (int u = ua; u <= ub; ++u) {
    slots[u] = static_cast<int64_t>(table[blk]) * bs + off;
    if (++off == bs) {
      off = 0;
      ++blk;
    }
  }
}

// Keys ua..ub of a key block: bit u for key u.
inline uint64_t visible_keys(int ua, int ub) { return (~uint64_t{0} >> (KEY_BLOCK - 1 - ub)) & (~uint64_t{0} << ua); }

// The lanes of score vector `sub` (keys 16 sub .. 16 sub + 15) among `keys`.
inline simd::Mask sub_lanes(uint64_t keys, int sub) { return static_cast<simd::Mask>((keys >> (sub * LANES)) & 0xFFFFu); }

// Score vector `sub` of a block into its place in scores (a head's KEY_BLOCK), lanes outside `visible` -inf.
inline void store_scores(float* scores, uint64_t visible, int sub, F16 sc) {
  simd::store(scores + sub * LANES, simd::select(sub_lanes(visible, sub), simd::set1(NEG_INF), sc));
}

// One key block for one query, in three steps that the tile loop runs for all of its
// queries in turn (so each step is a long run of independent work):
// scores of all `group` heads (lanes outside ua..ub = -inf; a vector with none of them is not computed) ...
template <int CH>
inline void block_query_scores(const Problem& pb, const float* q, const float* const krow[KEY_BLOCK], int ua, int ub,
                               float* scores, RowsAhead& ahead) {
  const int D = pb.head_dim, chunks = D / LANES;
  const uint64_t visible = visible_keys(ua, ub);
  for (int g = 0; g < pb.group; ++g)
    for (int sub = 0; sub < SUBS; ++sub) {
      ahead.step();
      const F16 sc = sub_lanes(visible, sub) != 0 ? block_scores<CH>(q + g * D, krow + sub * LANES, chunks) : simd::zero();
      store_scores(scores + g * KEY_BLOCK, visible, sub, sc);
    }
}

// ... the online-softmax update of (m, l), scores -> probabilities, and the rescale factor
// corr = exp(m - m') of the state: exactly 0 on the first block (m = -inf), and exactly 1
// when the max did not move, the common case once a sequence's large scores are seen, so
// that case skips the exp (same bits: exp(0) is 1 and l * 1 + p rounds like l + p) ...
inline void block_query_softmax(int group, int ua, int ub, float* m, F16* l, float* probs, float* corr) {
  const uint64_t visible = visible_keys(ua, ub);
  for (int g = 0; g < group; ++g) {
    float* p = probs + g * KEY_BLOCK;
    F16 sc[SUBS];
    for (int sub = 0; sub < SUBS; ++sub) sc[sub] = simd::load(p + sub * LANES);
    const F16 m_old = simd::set1(m[g]);
    const F16 m_new = simd::max(m_old, simd::max_all_lanes(simd::max(simd::max(sc[0], sc[1]), simd::max(sc[2], sc[3]))));
    const float m_new1 = simd::first(m_new);
    F16 pr[SUBS];
    for (int sub = 0; sub < SUBS; ++sub) {
      const simd::Mask lanes = sub_lanes(visible, sub);
      pr[sub] = lanes != 0 ? exp_nonpositive(simd::sub(sc[sub], m_new), lanes) : simd::zero();
      simd::store(p + sub * LANES, pr[sub]);
    }
    const F16 psum = simd::add(simd::add(pr[0], pr[1]), simd::add(pr[2], pr[3]));
    if (m_new1 == m[g]) {  // the usual case once the big scores are seen: corr = exp(0) = 1 exactly
      l[g] = simd::add(l[g], psum);
      corr[g] = 1.0f;
    } else {
      const F16 c = exp_nonpositive(simd::sub(m_old, m_new), 0xFFFF);
      l[g] = simd::fmadd(l[g], c, psum);
      corr[g] = simd::first(c);
    }
    m[g] = m_new1;
  }
}

// ... and acc = acc * corr + P @ V over the visible keys.
template <typename KT>
inline void block_query_pv(const Problem& pb, float* acc, const float* probs, const float* corr,
                           const KT* const vrow[KEY_BLOCK], int ua, int ub, RowsAhead& ahead) {
  const int D = pb.head_dim, chunks = D / LANES;
  for (int g0 = 0; g0 < pb.group; g0 += PV_HEADS) {
    const int ng = std::min(PV_HEADS, pb.group - g0);
    for (int c0 = 0; c0 < chunks; c0 += PV_COLUMNS)
      pv_kernel<KT>(ng, std::min(PV_COLUMNS, chunks - c0))(acc + g0 * D, D, probs + g0 * KEY_BLOCK, corr + g0, vrow,
                                                           ua, ub, c0, ahead);
  }
}

#if defined(PROTOSERVE_SIMD_BF16)
// P @ V in pairs of keys (2j, 2j+1), so that one instruction adds p_2j v_2j + p_2j+1 v_2j+1 for 16
// columns:
//   bfloat16 pools: vdpbf16ps, the block's probabilities rounded to bfloat16 (as GPU flash attention
//     feeds P to its bf16 matmul; l keeps the float32 sum), from acc * corr;
//   int8 pools: vpdpwssd, the weights p_u * (V row u's scale) as int16 codes round(p_u * vq_u) with
//     vq_u = (V row u's scale) * 32767 / (the largest such scale among the query's keys of the block,
//     value_weights), so that p <= 1 keeps them in range, against the V codes widened to int16; the
//     block's exact int32 sums (|sum| <= 64 * 32767 * 127 < 2^31) join as acc * corr + sums * that scale / 32767.
// The pair's V rows are interleaved by unpacklo/hi_epi16 inside each 128-bit lane, once per tile,
// block and KV head (unpack_values), so the accumulators hold each 32-column chunk as (lo: columns
// 8L+0..3, hi: 8L+4..7 of lanes L = 0..3); store_pair_acc restores the order. Per column: one chain
// over the query's own pairs, ascending; an invisible key of a pair has p exactly 0 and adds exactly 0.
//
// vp[(j * C32 + c) * 2 + 0 / 1]: pair j's interleaved chunk c (of C32 = D / 32), low / high half.
template <int C32, typename KT>
inline void unpack_values(const RowsView<KT>& vrow, __m512i* vp) {
#pragma GCC unroll 8
  for (int j = 0; j < KEY_BLOCK / 2; ++j)
#pragma GCC unroll 4
    for (int c = 0; c < C32; ++c) {
      const __m512i v0 = load_pairs(vrow[2 * j] + c * 32), v1 = load_pairs(vrow[2 * j + 1] + c * 32);
      _mm512_store_si512(vp + (j * C32 + c) * 2, _mm512_unpacklo_epi16(v0, v1));
      _mm512_store_si512(vp + (j * C32 + c) * 2 + 1, _mm512_unpackhi_epi16(v0, v1));
    }
}

// An int8 pool's P @ V weights for one query and block: vq (KEY_BLOCK factors) as above; returns the sums'
// scale (max V row scale among keys ua..ub) / 32767. Only the query's own keys decide it: batch invariant.
inline float value_weights(const float* vscale, int ua, int ub, float* vq) {
  const uint64_t visible = visible_keys(ua, ub);
  F16 m = simd::zero();
  for (int sub = 0; sub < SUBS; ++sub) m = simd::max(m, simd::keep(sub_lanes(visible, sub), simd::load(vscale + sub * LANES)));
  const float vmax = simd::reduce_max(m);
  const F16 inv = simd::set1(vmax == 0.0f ? 0.0f : 32767.0f / vmax);
  for (int sub = 0; sub < SUBS; ++sub) simd::store(vq + sub * LANES, simd::mul(simd::load(vscale + sub * LANES), inv));
  return vmax / 32767.0f;
}

// The G heads' pair weights for one block (pairs[g] as KEY_BLOCK 16-bit values): bfloat16 P, or the int16
// codes round(P * vq) (value_weights).
template <int G, bool INT16>
inline void pair_weights(const float* probs, const float* vq, uint32_t pairs[G][KEY_BLOCK / 2]) {
  for (int g = 0; g < G; ++g) {
    uint16_t* out = reinterpret_cast<uint16_t*>(pairs[g]);
    const float* p = probs + g * KEY_BLOCK;
    for (int sub = 0; sub < SUBS; ++sub) {
      if constexpr (INT16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + sub * LANES),
                            _mm512_cvtepi32_epi16(simd::to_int(simd::mul(simd::load(p + sub * LANES),
                                                                         simd::load(vq + sub * LANES)))));
      else
        simd::store_bf16(out + sub * LANES, simd::load(p + sub * LANES));
    }
  }
}

// VP: const __m512i* (the block's pairs from unpack_values) or the block's V rows (RowsView), interleaved
// here: a tile of one query, as decode's, reads each pair once. The same chains either way.
// vq, wscale: an int8 pool's weight factors and sums' scale (value_weights).
template <int G, int CC, typename VP, bool INT16>
void pv_tile_pairs(float* acc, int head_dim, const float* probs, const float* corr, const float* vq, float wscale,
                   VP vsrc, int ja, int jb, int c0, RowsAhead& ahead) {
  const int c32 = head_dim / 32;
  F16 a[G][2 * CC];
  uint32_t pairs[G][KEY_BLOCK / 2];
  pair_weights<G, INT16>(probs, vq, pairs);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * CC; ++c)
      a[g][c] = INT16 ? simd::zero() : simd::mul(simd::load(acc + g * head_dim + (2 * c0 + c) * LANES), simd::set1(corr[g]));
  for (int j = ja; j <= jb; ++j) {
    ahead.step();
    __m512i v[2 * CC];
    if constexpr (std::is_same_v<VP, const __m512i*>) {
      for (int c = 0; c < 2 * CC; ++c) v[c] = _mm512_load_si512(vsrc + (j * c32 + c0) * 2 + c);
    } else {
      for (int c = 0; c < CC; ++c) {
        const __m512i v0 = load_pairs(vsrc[2 * j] + (c0 + c) * 32);
        const __m512i v1 = load_pairs(vsrc[2 * j + 1] + (c0 + c) * 32);
        v[2 * c] = _mm512_unpacklo_epi16(v0, v1);
        v[2 * c + 1] = _mm512_unpackhi_epi16(v0, v1);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512i pj = _mm512_set1_epi32(static_cast<int>(pairs[g][j]));
      for (int c = 0; c < 2 * CC; ++c) a[g][c] = dot_pairs<INT16>(a[g][c], v[c], pj);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * CC; ++c) {
      float* out = acc + g * head_dim + (2 * c0 + c) * LANES;
      if constexpr (INT16)
        simd::store(out, simd::fmadd(simd::to_float(_mm512_castps_si512(a[g][c])), simd::set1(wscale),
                                     simd::mul(simd::load(out), simd::set1(corr[g]))));
      else
        simd::store(out, a[g][c]);
    }
}

template <typename VP>
using PvPairsFn = void (*)(float*, int, const float*, const float*, const float*, float, VP, int, int, int, RowsAhead&);

template <int G, typename VP, bool INT16>
constexpr PvPairsFn<VP> pv_pairs_for_cc(int cc) {
  return cc == 1 ? &pv_tile_pairs<G, 1, VP, INT16> : &pv_tile_pairs<G, 2, VP, INT16>;
}

template <typename VP, bool INT16>
inline PvPairsFn<VP> pv_pairs_kernel(int g, int cc) {
  switch (g) {
    case 1: return pv_pairs_for_cc<1, VP, INT16>(cc);
    case 2: return pv_pairs_for_cc<2, VP, INT16>(cc);
    case 3: return pv_pairs_for_cc<3, VP, INT16>(cc);
    default: return pv_pairs_for_cc<4, VP, INT16>(cc);
  }
}

// acc = acc * corr + P @ V over the key pairs holding the query's visible keys ua..ub; vq, wscale: an int8
// pool's value_weights for them.
template <bool INT16, typename VP>
inline void block_query_pv_pairs(const Problem& pb, float* acc, const float* probs, const float* corr,
                                 const float* vq, float wscale, VP vsrc, int ua, int ub, RowsAhead& ahead) {
  const int D = pb.head_dim, chunks32 = D / 32;
  for (int g0 = 0; g0 < pb.group; g0 += PV_HEADS) {
    const int ng = std::min(PV_HEADS, pb.group - g0);
    for (int c0 = 0; c0 < chunks32; c0 += 2)
      pv_pairs_kernel<VP, INT16>(ng, std::min(2, chunks32 - c0))(acc + g0 * D, D, probs + g0 * KEY_BLOCK, corr + g0,
                                                                 vq, wscale, vsrc, ua / 2, ub / 2, c0, ahead);
  }
}

// A head's accumulator from pv_tile_pairs' column order back to 0..D-1, divided by denom.
inline void store_pair_acc(float* out, const float* acc, int head_dim, F16 denom) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c = 0; c < head_dim / 32; ++c) {
    const F16 lo = simd::load(acc + 32 * c), hi = simd::load(acc + 32 * c + 16);
    simd::store(out + 32 * c, simd::div(_mm512_permutex2var_ps(lo, first, hi), denom));
    simd::store(out + 32 * c + 16, simd::div(_mm512_permutex2var_ps(lo, second, hi), denom));
  }
}
#endif

// A partition's state, or the fold so far: `states` (query, head) pairs of m, 16 l lanes and D accumulators.
struct StateView {
  float* m;
  float* l;  // 16 floats per state
  float* acc;
};

// The first key block of the unit a thread computes next: its rows are asked for during the
// current unit's last block, which would otherwise leave every unit's first block to wait on
// memory unasked.
template <typename PT>
struct FirstRows {
  const PT* kbase = nullptr;  // the unit's first KV head's rows (as attend_tile_vec's kbase/vbase)
  const PT* vbase = nullptr;
  int64_t slots[KEY_BLOCK];
  int last = -1;  // slots[0..last]; -1: no next unit
};

template <typename PT>
void first_rows(const Problem& pb, const Tile& tile, int kvh0, KeyRange keys, FirstRows<PT>& out) {
  const int32_t* table = pb.block_tables + static_cast<int64_t>(tile.seq) * pb.max_blocks;
  const int lo = std::max(first_key(pb, tile.pos0), keys.lo), hi = std::min(tile.pos0 + tile.n - 1, keys.hi);
  out.kbase = static_cast<const PT*>(pb.k) + static_cast<int64_t>(kvh0) * pb.kv_row;
  out.vbase = static_cast<const PT*>(pb.v) + static_cast<int64_t>(kvh0) * pb.kv_row;
  out.last = std::min(hi - lo, KEY_BLOCK - 1 - lo % KEY_BLOCK);
  block_slots(pb, table, lo, 0, out.last, out.slots);
}

// The tile's queries for KV heads kvh0 .. kvh0 + nkv - 1, D % 16 == 0. One head per unit spreads a
// short batch over the threads; all heads in one unit read each cached row (all heads side by side)
// in one pass, which DRAM serves far better than three interleaved strided walks. Either way each
// (query, head) runs the same operations on the same rows in the same order: the same bits.
// It leaves each (query, head)'s state in s.acc / s.m / s.l (only keys within `keys`).
// PT: the pool's element type; KT: the type its rows are read as (row_t).
template <typename PT, int CH>
void attend_tile_vec(const Problem& pb, const Tile& tile, int kvh0, int nkv, KeyRange keys, Scratch& s,
                     const FirstRows<PT>& after, const StateView* resume = nullptr) {
  using KT = row_t<PT, CH>;
  constexpr bool int8_pool = std::is_same_v<PT, int8_t>;
  const int D = pb.head_dim, R = pb.kv_row, chunks = D / LANES, G = pb.group, GD = G * D, HG = nkv * G, HGD = nkv * GD;
  const int32_t* table = pb.block_tables + static_cast<int64_t>(tile.seq) * pb.max_blocks;
  const int64_t row_stride = static_cast<int64_t>(pb.num_kv_heads) * R;
  const PT* kbase = static_cast<const PT*>(pb.k) + static_cast<int64_t>(kvh0) * R;
  const PT* vbase = static_cast<const PT*>(pb.v) + static_cast<int64_t>(kvh0) * R;

  constexpr bool bf16_products = uses_bf16_products<KT, CH>, int16_products = uses_int16_products<KT, CH>;
  constexpr bool pair_products = bf16_products || int16_products;
  const F16 scale = simd::set1(pb.scale);
  for (int i = 0; i < tile.n; ++i) {  // the unit's heads are consecutive in a query row
    const int64_t row = tile.rows != nullptr ? tile.rows[i] : tile.row + i;
    const float* qrow = pb.q + row * pb.q_stride + static_cast<int64_t>(kvh0) * GD;
    for (int e = 0; e < HGD; e += LANES) {
      const F16 scaled = simd::mul(simd::load(qrow + e), scale);
#if defined(PROTOSERVE_SIMD_BF16)
      if constexpr (bf16_products) {
        simd::store_bf16(&s.qb[i * HGD + e], scaled);
        continue;
      }
#endif
      simd::store(&s.q[i * HGD + e], scaled);
    }
#if defined(PROTOSERVE_SIMD_BF16)
    if constexpr (int16_products)
      for (int hg = 0; hg < HG; ++hg) s.qscale[i * HG + hg] = quantize_query(&s.q[i * HGD + hg * D], D, &s.qb[i * HGD + hg * D]);
#endif
  }
  if (resume != nullptr) {  // the walk so far, up to keys.lo (a shared tile's): it goes on from there
    std::copy(resume->m, resume->m + tile.n * HG, s.m.begin());
    std::copy(resume->l, resume->l + tile.n * HG * LANES, reinterpret_cast<float*>(s.l.data()));
    std::copy(resume->acc, resume->acc + tile.n * HGD, s.acc.begin());
  } else {
    std::fill(s.acc.begin(), s.acc.begin() + tile.n * HGD, 0.0f);
    std::fill(s.m.begin(), s.m.begin() + tile.n * HG, NEG_INF);
    std::fill(s.l.begin(), s.l.begin() + tile.n * HG, simd::zero());
  }

  // Key blocks in ascending order. Per block and KV head: the rows of every key any query of the
  // tile sees, then for each query its own lanes qa..qb (none when qa > qb: the block is outside
  // its range), its scores, its softmax update, its P @ V. Each step runs over all the
  // tile's queries before the next, so the core has independent work to overlap.
  const int tile_lo = std::max(first_key(pb, tile.pos0), keys.lo), tile_hi = std::min(tile.pos0 + tile.n - 1, keys.hi);
  const int kb_last = tile_hi / KEY_BLOCK;
  const float* krow[KEY_BLOCK];
  const KT* vrow[KEY_BLOCK];
  alignas(64) float kscale[KEY_BLOCK], vscale[KEY_BLOCK];  // int16 products: the rows' scales
  int qa[QUERY_TILE], qb[QUERY_TILE];
  int64_t offsets[KEY_BLOCK];  // the block's rows' byte offsets in the pool (block_slots' slots, scaled)
  const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(PT));
  const int lines = row_lines(R * static_cast<int>(sizeof(PT)));
  for (int kb = tile_lo / KEY_BLOCK; kb <= kb_last; ++kb) {
    const int j0 = kb * KEY_BLOCK;
    const int ua = std::max(tile_lo - j0, 0), ub = std::min(tile_hi - j0, KEY_BLOCK - 1);
    block_slots(pb, table, j0, ua, ub, offsets);
    for (int u = ua; u <= ub; ++u) offsets[u] *= row_bytes;
    std::fill(offsets, offsets + ua, offsets[ua]);  // lanes no query sees: a readable row (and a finite scale)
    std::fill(offsets + ub + 1, offsets + KEY_BLOCK, offsets[ub]);
    // The next block's rows, whose first head's are asked for while this block's last head computes
    // (RowsAhead); the last block asks for the next unit's first rows instead.
    int64_t next_offsets[KEY_BLOCK];
    const PT* next_k = kbase;
    const PT* next_v = vbase;
    int next_ub = -1;
    if (kb < kb_last) {
      next_ub = std::min(tile_hi - j0 - KEY_BLOCK, KEY_BLOCK - 1);
      block_slots(pb, table, j0 + KEY_BLOCK, 0, next_ub, next_offsets);
    } else if (after.last >= 0) {
      next_ub = after.last;
      next_k = after.kbase;
      next_v = after.vbase;
      std::copy(after.slots, after.slots + next_ub + 1, next_offsets);
    }
    for (int u = 0; u <= next_ub; ++u) next_offsets[u] *= row_bytes;
    for (int i = 0; i < tile.n; ++i) {
      const int pos = tile.pos0 + i;
      qa[i] = std::max(std::max(first_key(pb, pos), keys.lo) - j0, 0);
      qb[i] = std::min(std::min(pos, keys.hi) - j0, KEY_BLOCK - 1);
    }
    for (int h = 0; h < nkv; ++h) {
      const bool last_head = h + 1 == nkv;
      RowsAhead ahead(last_head ? next_k : kbase + (h + 1) * R, last_head ? next_v : vbase + (h + 1) * R,
                      last_head ? next_offsets : offsets + ua, (last_head ? next_ub : ub - ua) + 1, lines,
                      steps_per_row(tile.n));
      const int dose = ahead.left() / 8;
      ahead.issue(dose);
      const char* kh = reinterpret_cast<const char*>(kbase + h * R);
      const char* vh = reinterpret_cast<const char*>(vbase + h * R);
      const RowsView<KT> krows{kh, offsets}, vrows{vh, offsets};
      if constexpr (int16_products)
        for (int u = 0; u < KEY_BLOCK; ++u) kscale[u] = int8_row_scale(krows[u], D), vscale[u] = int8_row_scale(vrows[u], D);
      if constexpr (!pair_products) {  // the rows in place or widened
        for (int u = ua; u <= ub; ++u) {
          const PT* k = reinterpret_cast<const PT*>(kh + offsets[u]);
          const PT* v = reinterpret_cast<const PT*>(vh + offsets[u]);
          if constexpr (int8_pool) {  // widened once per block and head, not once per query head
            widen_int8_row(k, D, &s.kbuf[u * D]);
            if (v != k) widen_int8_row(v, D, &s.vbuf[u * D]);  // one shared pool (latent attention): its rows once
            krow[u] = &s.kbuf[u * D];
            vrow[u] = v != k ? &s.vbuf[u * D] : &s.kbuf[u * D];
          } else {
            vrow[u] = v;
            if constexpr (std::is_same_v<KT, float>) {
              krow[u] = k;
            } else {  // widen once per block and head, not once per query head
              float* dst = &s.kbuf[u * D];
              for (int c = 0; c < chunks; ++c) simd::store(dst + c * LANES, load16(k + c * LANES));
              krow[u] = dst;
            }
          }
        }
        for (int u = 0; u < ua; ++u) krow[u] = krow[ua];  // lanes no query sees: any readable row
        for (int u = ub + 1; u < KEY_BLOCK; ++u) krow[u] = krow[ub];
      }

#if defined(PROTOSERVE_SIMD_BF16)
      if constexpr (pair_products) {
        // The block transposed once for all the tile's query heads, then their scores SCORE_HEADS at a time.
        __m512i* kt = reinterpret_cast<__m512i*>(s.kt.data());
        transpose_keys<CH * 8>(krows, kt);
        int vis[QUERY_TILE], nvis = 0;
        for (int i = 0; i < tile.n; ++i)
          if (qa[i] <= qb[i]) vis[nvis++] = i;
        for (int t0 = 0; t0 < nvis * G; t0 += SCORE_HEADS) {
          const int n = std::min(SCORE_HEADS, nvis * G - t0);
          const uint16_t* qp[SCORE_HEADS];
          F16 sc[SCORE_HEADS * SUBS];
          for (int r = 0; r < n; ++r) {
            const int i = vis[(t0 + r) / G], g = (t0 + r) % G;
            qp[r] = &s.qb[i * HGD + h * GD + g * D];
          }
          column_scores_n<CH * 8, int16_products>(n, kt, qp, sc, ahead);
          for (int r = 0; r < n; ++r) {
            const int i = vis[(t0 + r) / G], g = (t0 + r) % G;
            const uint64_t visible = visible_keys(qa[i], qb[i]);
            for (int sub = 0; sub < SUBS; ++sub) {
              F16 score = sc[r * SUBS + sub];
              if constexpr (int16_products)  // the integer sum times the query's and the key's scales
                score = simd::mul(simd::mul(simd::to_float(_mm512_castps_si512(score)),
                                            simd::set1(s.qscale[i * HG + h * G + g])),
                                  simd::load(kscale + sub * LANES));
              store_scores(&s.probs[(i * HG + h * G + g) * KEY_BLOCK], visible, sub, score);
            }
          }
        }
      } else
#endif
      {
        for (int i = 0; i < tile.n; ++i)
          if (qa[i] <= qb[i])
            block_query_scores<CH>(pb, &s.q[i * HGD + h * GD], krow, qa[i], qb[i], &s.probs[(i * HG + h * G) * KEY_BLOCK], ahead);
      }
      ahead.issue(dose);
      for (int i = 0; i < tile.n; ++i)
        if (qa[i] <= qb[i])
          block_query_softmax(G, qa[i], qb[i], &s.m[i * HG + h * G], &s.l[i * HG + h * G],
                              &s.probs[(i * HG + h * G) * KEY_BLOCK], &s.corr[i * HG + h * G]);
      ahead.issue(dose);
#if defined(PROTOSERVE_SIMD_BF16)
      if constexpr (pair_products)
        if (tile.n > 1) unpack_values<CH / 2>(vrows, reinterpret_cast<__m512i*>(s.vp.data()));
#endif
      alignas(64) float vq[KEY_BLOCK];
      float wscale = 0.0f;
      int vq_lo = -1, vq_hi = -1;  // the keys vq was made for: a tile's queries mostly share them
      for (int i = 0; i < tile.n; ++i) {
        if (qa[i] > qb[i]) continue;
        const float* probs = &s.probs[(i * HG + h * G) * KEY_BLOCK];
#if defined(PROTOSERVE_SIMD_BF16)
        if constexpr (pair_products) {
          if (int16_products && (qa[i] != vq_lo || qb[i] != vq_hi))
            wscale = value_weights(vscale, qa[i], qb[i], vq), vq_lo = qa[i], vq_hi = qb[i];
          if (tile.n > 1)
            block_query_pv_pairs<int16_products>(pb, &s.acc[i * HGD + h * GD], probs, &s.corr[i * HG + h * G], vq,
                                                 wscale, reinterpret_cast<const __m512i*>(s.vp.data()), qa[i], qb[i],
                                                 ahead);
          else
            block_query_pv_pairs<int16_products>(pb, &s.acc[i * HGD + h * GD], probs, &s.corr[i * HG + h * G], vq,
                                                 wscale, vrows, qa[i], qb[i], ahead);
          continue;
        }
#endif
        if constexpr (!pair_products)
          block_query_pv<KT>(pb, &s.acc[i * HGD + h * GD], probs, &s.corr[i * HG + h * G], vrow, qa[i], qb[i], ahead);
      }
      ahead.issue(ahead.left());
    }
  }
}

// The tile's output rows for its heads kvh0 .. kvh0 + nkv - 1: acc / sum of l's lanes, from a state laid
// out as Scratch's ([query, head] of D accumulators and of 16 l lanes).
template <typename KT, int CH>
void write_out(const Problem& pb, const Tile& tile, int kvh0, int nkv, const float* acc_all, const F16* l) {
  const int D = pb.head_dim, chunks = D / LANES, G = pb.group, HG = nkv * G, HGD = HG * D;
  for (int i = 0; i < tile.n; ++i) {
    float* orow = pb.out + ((tile.row + i) * pb.num_heads + static_cast<int64_t>(kvh0) * G) * D;
    for (int g = 0; g < HG; ++g) {
      const F16 denom = simd::set1(simd::reduce_add(l[i * HG + g]));
      const float* acc = acc_all + i * HGD + g * D;
#if defined(PROTOSERVE_SIMD_BF16)
      if constexpr (uses_pair_products<KT, CH>) {
        store_pair_acc(orow + g * D, acc, D, denom);
        continue;
      }
#endif
      for (int c = 0; c < chunks; ++c)
        simd::store(orow + g * D + c * LANES, simd::div(simd::load(acc + c * LANES), denom));
    }
  }
}

// ---- partitions ---------------------------------------------------------------------------

inline StateView scratch_state(Scratch& s) { return {s.m.data(), reinterpret_cast<float*>(s.l.data()), s.acc.data()}; }
inline StateView fold_state(Scratch& s) { return {s.fm.data(), reinterpret_cast<float*>(s.fl.data()), s.facc.data()}; }

// A split tile's slot in plan.partials, one per partition: its `states` (query, head) pairs' m, then l
// lanes, then accumulators.
inline int64_t slot_floats(int64_t states, int head_dim) { return states * (1 + LANES + head_dim); }
inline StateView slot_state(float* slot, int64_t states) { return {slot, slot + states, slot + states * (1 + LANES)}; }

inline void copy_state(StateView from, StateView to, int states, int head_dim) {
  std::copy(from.m, from.m + states, to.m);
  std::copy(from.l, from.l + states * LANES, to.l);
  std::copy(from.acc, from.acc + static_cast<int64_t>(states) * head_dim, to.acc);
}

inline void clear_fold(StateView fold, int states) { std::fill(fold.m, fold.m + states, NEG_INF); }

// fold = fold (+) part for each state, as the top of this file says: a state the partition did not reach
// (m = -inf) leaves the fold as it is; into an empty fold the partition's state is copied; otherwise
// both are rescaled to the larger max (one factor is exp(0) = 1 exactly) and added.
inline void fold_in(StateView fold, StateView part, int states, int head_dim) {
  for (int e = 0; e < states; ++e) {
    const float mp = part.m[e], mf = fold.m[e];
    float* la = fold.l + e * LANES;
    float* aa = fold.acc + static_cast<int64_t>(e) * head_dim;
    const float* lb = part.l + e * LANES;
    const float* ab = part.acc + static_cast<int64_t>(e) * head_dim;
    if (mp == NEG_INF) continue;
    if (mf == NEG_INF) {
      fold.m[e] = mp;
      std::copy(lb, lb + LANES, la);
      std::copy(ab, ab + head_dim, aa);
      continue;
    }
    const float M = std::max(mf, mp);
    const F16 ca = exp_nonpositive(simd::set1(mf - M), 0xFFFF), cb = exp_nonpositive(simd::set1(mp - M), 0xFFFF);
    simd::store(la, simd::fmadd(simd::load(lb), cb, simd::mul(simd::load(la), ca)));
    for (int d = 0; d < head_dim; d += LANES)
      simd::store(aa + d, simd::fmadd(simd::load(ab + d), cb, simd::mul(simd::load(aa + d), ca)));
    fold.m[e] = M;
  }
}

inline int first_part(const Problem& pb, const Tile& tile) { return first_key(pb, tile.pos0) / PARTITION; }
inline int last_part(const Tile& tile) { return (tile.pos0 + tile.n - 1) / PARTITION; }

// Split tile t's state for partition `part` (all KV heads) into its slot; whichever call leaves the
// tile's last partition folds them all in ascending order and writes the tile's rows.
template <typename PT, int CH>
void leave_part(const Problem& pb, const protoserve::AttentionPlan& plan, int32_t t, int part, StateView state,
                Scratch& s) {
  const Tile& tile = plan.tiles[t];
  const int states = tile.n * pb.num_heads, p0 = first_part(pb, tile), p1 = last_part(tile);
  float* slots = plan.partials.data() + plan.tile_slot[t];
  const int64_t stride = slot_floats(states, pb.head_dim);
  copy_state(state, slot_state(slots + (part - p0) * stride, states), states, pb.head_dim);
  std::atomic<int32_t>& done = plan.done[t];
  if (done.fetch_add(1, std::memory_order_acq_rel) != p1 - p0) return;
  done.store(0, std::memory_order_relaxed);  // the next call's count starts afresh
  const StateView fold = fold_state(s);
  clear_fold(fold, states);
  for (int p = 0; p <= p1 - p0; ++p)
    fold_in(fold, slot_state(slots + p * stride, states), states, pb.head_dim);
  write_out<row_t<PT, CH>, CH>(pb, tile, 0, pb.num_kv_heads, s.facc.data(), s.fl.data());
}

// One unit on the vector path. A whole tile walks its partitions in turn (its rows prefetched across
// the partition boundaries) and folds them; a split tile's partition leaves its state in the plan's
// slot (leave_part). A shared tile walks the key blocks its queries share, from a partition's start,
// once for all of them; each query then walks the rest of that partition from its own state and leaves
// it in its member tile's slot: every query's operations are those of its own walk, in its order.
template <typename PT, int CH>
void unit_vec(const Problem& pb, const protoserve::AttentionPlan& plan, const protoserve::AttentionUnit& unit,
              Scratch& s, const FirstRows<PT>& after) {
  const Tile& tile = plan.tiles[unit.tile];
  const int states = tile.n * unit.nkv * pb.group, p0 = first_part(pb, tile), p1 = last_part(tile);
  if (unit.part >= 0) {  // all KV heads (cut_units); a shared tile's keys end at its pos0
    const KeyRange part = KeyRange::of_part(unit.part);
    attend_tile_vec<PT, CH>(pb, tile, unit.kvh0, unit.nkv,
                            tile.members != nullptr ? KeyRange{part.lo, tile.pos0} : part, s, after);
    if (tile.members == nullptr) {
      leave_part<PT, CH>(pb, plan, unit.tile, unit.part, scratch_state(s), s);
      return;
    }
    // The shared blocks' states, held: each query walks the rest of its partition from its own.
    const int64_t H = pb.num_heads, D = pb.head_dim;
    const StateView held{s.hm.data(), reinterpret_cast<float*>(s.hl.data()), s.hacc.data()};
    copy_state(scratch_state(s), held, static_cast<int>(tile.n * H), pb.head_dim);
    const KeyRange rest{tile.pos0 + 1, unit.part * PARTITION + PARTITION - 1};
    for (int i = 0; i < tile.n; ++i) {
      const int32_t t = tile.members[i];
      const StateView mine{held.m + i * H, held.l + i * H * LANES, held.acc + i * H * D};
      if (plan.tiles[t].pos0 < rest.lo) {  // it sees nothing past the shared blocks
        leave_part<PT, CH>(pb, plan, t, unit.part, mine, s);
        continue;
      }
      attend_tile_vec<PT, CH>(pb, plan.tiles[t], 0, pb.num_kv_heads, rest, s, after, &mine);
      leave_part<PT, CH>(pb, plan, t, unit.part, scratch_state(s), s);
    }
    return;
  }
  if (p0 == p1) {  // the common case: one walk, no fold
    attend_tile_vec<PT, CH>(pb, tile, unit.kvh0, unit.nkv, KeyRange::of_part(p0), s, after);
    write_out<row_t<PT, CH>, CH>(pb, tile, unit.kvh0, unit.nkv, s.acc.data(), s.l.data());
    return;
  }
  const StateView fold = fold_state(s);
  clear_fold(fold, states);
  for (int p = p0; p <= p1; ++p) {
    FirstRows<PT> next;
    if (p < p1) first_rows(pb, tile, unit.kvh0, KeyRange::of_part(p + 1), next);
    attend_tile_vec<PT, CH>(pb, tile, unit.kvh0, unit.nkv, KeyRange::of_part(p), s, p < p1 ? next : after);
    fold_in(fold, scratch_state(s), states, pb.head_dim);
  }
  write_out<row_t<PT, CH>, CH>(pb, tile, unit.kvh0, unit.nkv, s.facc.data(), s.fl.data());
}

// Any D: each query of the tile alone, the same block walk in plain scalar code.
template <typename KT>
void attend_tile_scalar(const Problem& pb, const Tile& tile, int kvh, Scratch& s) {
  const int D = pb.head_dim, G = pb.group;
  const int32_t* table = pb.block_tables + static_cast<int64_t>(tile.seq) * pb.max_blocks;
  const int64_t row_stride = static_cast<int64_t>(pb.num_kv_heads) * D;
  const KT* kbase = static_cast<const KT*>(pb.k) + static_cast<int64_t>(kvh) * D;
  const KT* vbase = static_cast<const KT*>(pb.v) + static_cast<int64_t>(kvh) * D;
  int64_t slots[KEY_BLOCK];
  float sc[KEY_BLOCK];
  for (int i = 0; i < tile.n; ++i) {
    const int p = tile.pos0 + i, lo = first_key(pb, p);
    const float* qrow = pb.q + (tile.row + i) * pb.q_stride + static_cast<int64_t>(kvh) * G * D;
    float* orow = pb.out + ((tile.row + i) * pb.num_heads + static_cast<int64_t>(kvh) * G) * D;
    for (int g = 0; g < G; ++g) {
      const float* q = qrow + g * D;
      float* acc = s.acc.data();
      std::fill(acc, acc + D, 0.0f);
      float m = NEG_INF, l = 0.0f;
      for (int kb = lo / KEY_BLOCK; kb <= p / KEY_BLOCK; ++kb) {
        const int j0 = kb * KEY_BLOCK;
        const int ua = std::max(lo - j0, 0), ub = std::min(p - j0, KEY_BLOCK - 1);
        block_slots(pb, table, j0, ua, ub, slots);
        float bmax = NEG_INF;
        for (int u = ua; u <= ub; ++u) {
          const KT* k = kbase + slots[u] * row_stride;
          float dot = 0.0f;
          for (int d = 0; d < D; ++d) dot += (q[d] * pb.scale) * load1(k + d);
          sc[u] = dot;
          bmax = std::max(bmax, dot);
        }
        const float m_new = std::max(m, bmax);
        const float corr = m == m_new ? 1.0f : (m == NEG_INF ? 0.0f : std::exp(m - m_new));
        l *= corr;
        for (int d = 0; d < D; ++d) acc[d] *= corr;
        for (int u = ua; u <= ub; ++u) {
          const float pu = std::exp(sc[u] - m_new);
          l += pu;
          const KT* v = vbase + slots[u] * row_stride;
          for (int d = 0; d < D; ++d) acc[d] += pu * load1(v + d);
        }
        m = m_new;
      }
      for (int d = 0; d < D; ++d) orow[g * D + d] = acc[d] / l;
    }
  }
}

template <typename PT>
void run(const Problem& pb, const protoserve::AttentionPlan& plan, const protoserve::Team* team,
         std::atomic<int64_t>& next) {
  const int threads = team != nullptr ? team->size : at::get_num_threads();
  const int64_t units = static_cast<int64_t>(plan.units.size());
  const bool vector = pb.head_dim % LANES == 0;
  // Units are handed out one at a time: a causal prefill's units differ many-fold in cost,
  // and which thread runs a unit changes nothing in its result.
  auto worker = [&]() {
    thread_local Scratch scratch;
    scratch.fit(pb);
    // A thread claims its next unit before computing the current one, so that the current one's
    // last block can ask for the next one's first rows (which thread computes a unit, and when,
    // changes nothing in its result).
    int64_t u = next.fetch_add(1, std::memory_order_relaxed);
    while (u < units) {
      const int64_t following = next.fetch_add(1, std::memory_order_relaxed);
      FirstRows<PT> after;
      if (vector && following < units) {
        const protoserve::AttentionUnit& f = plan.units[following];
        const Tile& ft = plan.tiles[f.tile];
        first_rows(pb, ft, f.kvh0, KeyRange::of_part(f.part >= 0 ? f.part : first_part(pb, ft)), after);
      }
      const protoserve::AttentionUnit& unit = plan.units[u];
      switch (pb.head_dim) {  // the common head sizes with the query held in registers
        case 16: unit_vec<PT, 1>(pb, plan, unit, scratch, after); break;
        case 32: unit_vec<PT, 2>(pb, plan, unit, scratch, after); break;
        case 64: unit_vec<PT, 4>(pb, plan, unit, scratch, after); break;
        case 128: unit_vec<PT, 8>(pb, plan, unit, scratch, after); break;
        default:
          if (vector) {
            unit_vec<PT, 0>(pb, plan, unit, scratch, after);
          } else if constexpr (!std::is_same_v<PT, int8_t>) {  // int8 pools need D % 16 == 0 (checked)
            for (int kvh = unit.kvh0; kvh < unit.kvh0 + unit.nkv; ++kvh)
              attend_tile_scalar<PT>(pb, plan.tiles[unit.tile], kvh, scratch);
          }
      }
      u = following;
    }
  };
  if (team != nullptr || threads <= 1 || units <= 1 || plan.total_work < MIN_PARALLEL_WORK ||
      at::in_parallel_region()) {
    worker();  // a team member takes units beside the others already running
  } else {
    at::parallel_for(0, std::min<int64_t>(threads, units), 1, [&](int64_t, int64_t) { worker(); });
  }
}

// Decode rows whose tables hold the same cache blocks from a partition's start (a prompt prefix in the
// prefix cache, a system prompt many conversations open with) walk those key blocks together, as one
// shared tile of up to QUERY_TILE queries: the blocks are loaded and transposed once for all of them,
// as a prompt's consecutive queries share theirs. Each such row's tile is then split by partition, and
// `shared` gets, per tile, the partitions its shared tiles compute (the rest of such a partition too).
// Only where every query sees all of the shared keys (no window) and key blocks hold whole cache blocks.
void share_prefix_blocks(protoserve::AttentionPlan& plan, std::vector<int64_t>& tile_work, int64_t block_size,
                      int64_t head_dim, std::vector<std::vector<int32_t>>& shared) {
  const size_t tiles = plan.tiles.size();
  shared.assign(tiles, {});
  if (plan.sliding_window > 0 || head_dim % LANES != 0 || KEY_BLOCK % block_size != 0 || tiles < 2) return;
  const int64_t per_key_block = KEY_BLOCK / block_size;
  const auto table_of = [&](int32_t t) {
    return plan.block_tables + static_cast<int64_t>(plan.tiles[t].seq) * plan.max_blocks;
  };
  // Cached prefixes are shared from their first block on: decodes whose first block no other holds share
  // nothing, and cost no more than this count.
  std::unordered_map<int32_t, int32_t> first_blocks;
  for (size_t t = 0; t < tiles; ++t)
    if (plan.tiles[t].n == 1 && plan.tiles[t].pos0 >= KEY_BLOCK - 1) ++first_blocks[table_of(static_cast<int32_t>(t))[0]];
  // (partition, the block ids of its first key block) -> the decode tiles whose table holds them, in order.
  std::map<std::vector<int32_t>, std::vector<int32_t>> groups;
  for (size_t t = 0; t < tiles; ++t) {
    const Tile& tile = plan.tiles[t];
    const int32_t* table = table_of(static_cast<int32_t>(t));
    if (tile.n != 1 || tile.pos0 < KEY_BLOCK - 1 || first_blocks[table[0]] < 2) continue;
    for (int p = 0; p * PARTITION + KEY_BLOCK - 1 <= tile.pos0; ++p) {
      const int64_t first = static_cast<int64_t>(p) * PARTITION / block_size;
      std::vector<int32_t> key{p};
      key.insert(key.end(), table + first, table + first + per_key_block);
      groups[key].push_back(static_cast<int32_t>(t));
    }
  }
  std::vector<std::pair<size_t, int64_t>> made;  // shared tile, its first entry in shared_rows / shared_members
  plan.shared_rows.clear();
  plan.shared_members.clear();
  for (const auto& [key, members] : groups) {
    const int p = key[0];
    for (size_t i0 = 0; i0 + 1 < members.size(); i0 += QUERY_TILE) {  // at least two queries a tile
      const int n = static_cast<int>(std::min<size_t>(QUERY_TILE, members.size() - i0));
      // Key blocks of the partition that every query of the tile sees and whose cache blocks all hold.
      int blocks = 1;
      while (blocks < PARTITION / KEY_BLOCK) {
        const int64_t end = static_cast<int64_t>(p) * PARTITION + (blocks + 1) * KEY_BLOCK;  // one past the next one
        const int64_t lo = (end - KEY_BLOCK) / block_size, hi = end / block_size;
        const int32_t* first = table_of(members[i0]);
        bool same = true;
        for (int i = 0; i < n && same; ++i) {
          const int32_t* table = table_of(members[i0 + i]);
          same = plan.tiles[members[i0 + i]].pos0 >= end - 1 && std::equal(first + lo, first + hi, table + lo);
        }
        if (!same) break;
        ++blocks;
      }
      made.emplace_back(plan.tiles.size(), static_cast<int64_t>(plan.shared_rows.size()));
      plan.tiles.push_back({-1, n, plan.tiles[members[i0]].seq, p * PARTITION + blocks * KEY_BLOCK - 1});
      tile_work.push_back(static_cast<int64_t>(n) * blocks * KEY_BLOCK);
      for (int i = 0; i < n; ++i) {
        const int32_t m = members[i0 + i];
        plan.shared_rows.push_back(plan.tiles[m].row);
        plan.shared_members.push_back(m);
        shared[m].push_back(p);
      }
    }
  }
  for (const auto& [t, first] : made) {  // the vectors are complete: point into them
    plan.tiles[t].rows = plan.shared_rows.data() + first;
    plan.tiles[t].members = plan.shared_members.data() + first;
  }
}

// The plan's units for `threads` threads. While tiles are too few to keep every thread busy (one
// stream's decode), a tile spanning several partitions is split into one unit per partition (all KV
// heads: each cached row read whole) and a one-partition tile into a unit per KV head; a tile holding
// more than its share of the call's work is split too, so that it does not finish last. Otherwise a
// unit is a whole tile with all its KV heads. A tile with partitions in shared tiles
// (share_prefix_blocks) is split, its own units covering the rest; shared tiles are a unit each. Split
// and shared tiles' units go first: they are the long ones.
void cut_units(protoserve::AttentionPlan& plan, const std::vector<int64_t>& tile_work, int64_t total_work,
               const std::vector<std::vector<int32_t>>& shared, int num_kv_heads, int num_heads, int head_dim,
               int threads) {
  const bool few = static_cast<int64_t>(plan.tiles.size()) < 2 * threads;
  const bool vector = head_dim % LANES == 0;
  plan.units.clear();
  plan.tile_slot.assign(plan.tiles.size(), -1);
  int64_t floats = 0;  // of plan.partials, for the split tiles' slots
  std::vector<protoserve::AttentionUnit> rest;
  static const std::vector<int32_t> none;
  for (size_t t = 0; t < plan.tiles.size(); ++t) {
    const Tile& tile = plan.tiles[t];
    const int p0 = (plan.sliding_window > 0 ? std::max<int64_t>(0, tile.pos0 - plan.sliding_window + 1) : 0) / PARTITION;
    const int p1 = (tile.pos0 + tile.n - 1) / PARTITION;
    const auto ti = static_cast<int32_t>(t);
    const auto kvh = static_cast<int16_t>(num_kv_heads);
    const std::vector<int32_t>& elsewhere = t < shared.size() ? shared[t] : none;
    if (tile.members != nullptr) {  // its one partition, the one ending at pos0
      plan.units.push_back({ti, 0, kvh, tile.pos0 / PARTITION});
    } else if (!elsewhere.empty()) {
      plan.tile_slot[t] = floats;
      floats += (p1 - p0 + 1) * slot_floats(static_cast<int64_t>(tile.n) * num_heads, head_dim);
      for (int p = p0; p <= p1; ++p)
        if (std::find(elsewhere.begin(), elsewhere.end(), p) == elsewhere.end()) plan.units.push_back({ti, 0, kvh, p});
    } else if (vector && p1 > p0 && threads > 1 && (few || tile_work[t] * 2 * threads > total_work)) {
      plan.tile_slot[t] = floats;
      floats += (p1 - p0 + 1) * slot_floats(static_cast<int64_t>(tile.n) * num_heads, head_dim);
      for (int p = p0; p <= p1; ++p) plan.units.push_back({ti, 0, kvh, p});
    } else if (few && threads > 1) {
      for (int h = 0; h < num_kv_heads; ++h) rest.push_back({ti, static_cast<int16_t>(h), 1, -1});
    } else {
      rest.push_back({ti, 0, kvh, -1});
    }
  }
  plan.units.insert(plan.units.end(), rest.begin(), rest.end());
  if (static_cast<int64_t>(plan.partials.size()) < floats) plan.partials.resize(floats);
  if (plan.done_size < static_cast<int64_t>(plan.tiles.size())) {
    plan.done_size = static_cast<int64_t>(plan.tiles.size());
    plan.done = std::make_unique<std::atomic<int32_t>[]>(plan.done_size);
  }
  for (int64_t t = 0; t < static_cast<int64_t>(plan.tiles.size()); ++t) plan.done[t].store(0, std::memory_order_relaxed);
}

}  // namespace

namespace protoserve {

bool attention_multiplies_in_bf16() { return BF16_ATTENTION; }

bool attention_int8_in_int16() { return INT16_ATTENTION; }

void plan_attention(AttentionPlan& plan, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                    const at::Tensor& seq_lens, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t num_blocks,
                    int64_t bs, int64_t sliding_window) {
  for (const auto* t : {&block_tables, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "block_tables, query_start_loc and seq_lens must be contiguous int32 CPU tensors");
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1 && query_start_loc.dim() == 1, "bad index shapes");
  const int64_t B = seq_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == B && query_start_loc.size(0) == B + 1,
              "block_tables must have B rows and query_start_loc B + 1 entries");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none)");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == T, "query_start_loc must run from 0 to T");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads ", H, " is not a multiple of num_kv_heads ", KVH);
  plan.tiles.clear();
  std::vector<int64_t> tile_work;  // visible (query, key) pairs of each tile
  int64_t total_work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = qsl[b], n = qsl[b + 1] - qsl[b], len = lens[b];
    TORCH_CHECK(n >= 0 && n <= len, "sequence ", b, ": ", n, " queries but a context of ", len);
    TORCH_CHECK(len <= max_blocks * bs, "sequence ", b, ": context ", len, " exceeds its block table");
    for (int64_t blk = 0; blk < (len + bs - 1) / bs; ++blk) {
      const int32_t id = tables[b * max_blocks + blk];
      TORCH_CHECK(id >= 0 && id < num_blocks, "sequence ", b, ": block id ", id, " out of range");
    }
    for (int64_t i0 = 0; i0 < n; i0 += QUERY_TILE) {
      const int64_t m = std::min<int64_t>(QUERY_TILE, n - i0);
      plan.tiles.push_back(
          {start + i0, static_cast<int32_t>(m), static_cast<int32_t>(b), static_cast<int32_t>(len - n + i0)});
      int64_t work = 0;
      for (int64_t pos = len - n + i0; pos < len - n + i0 + m; ++pos)
        work += sliding_window > 0 ? std::min<int64_t>(pos + 1, sliding_window) : pos + 1;
      tile_work.push_back(work);
      total_work += work;
    }
  }
  plan.total_work = total_work * H * D;
  plan.block_tables = tables;
  plan.max_blocks = max_blocks;
  plan.num_tokens = T;
  plan.sliding_window = sliding_window;
  std::vector<std::vector<int32_t>> shared;
  share_prefix_blocks(plan, tile_work, bs, D, shared);
  cut_units(plan, tile_work, total_work, shared, static_cast<int>(KVH), static_cast<int>(H), static_cast<int>(D),
            std::max(1, at::get_num_threads()));
}

std::tuple<int64_t, int64_t> attention_shared_tiles(const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                                    const at::Tensor& seq_lens, int64_t H, int64_t KVH, int64_t D,
                                                    int64_t num_blocks, int64_t bs, int64_t sliding_window) {
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.numel() > 0 && query_start_loc.scalar_type() == at::kInt,
              "query_start_loc must be a non-empty int32 vector");
  AttentionPlan plan;
  const int64_t T = query_start_loc.data_ptr<int32_t>()[query_start_loc.numel() - 1];
  plan_attention(plan, block_tables, query_start_loc, seq_lens, T, H, KVH, D, num_blocks, bs, sliding_window);
  int64_t tiles = 0, queries = 0;
  for (const AttentionTile& tile : plan.tiles)
    if (tile.members != nullptr) ++tiles, queries += tile.n;
  return {tiles, queries};
}

int64_t kv_pool_head_dim(const at::Tensor& pool) {
  return pool.size(3) - (pool.scalar_type() == at::kChar ? INT8_SCALE_BYTES : 0);
}

namespace {

void quantize_kv_row(const float* x, int64_t D, int8_t* row) {
  F16 m = simd::zero();
  for (int64_t d = 0; d < D; d += LANES) m = simd::max(m, simd::abs(simd::load(x + d)));
  const float amax = simd::reduce_max(m);
  const float scale = amax / 127.0f;
  // Round to nearest even (the default MXCSR mode); an all-zero row keeps codes 0 and scale 0.
  const F16 inv = simd::set1(amax == 0.0f ? 0.0f : 127.0f / amax);
  for (int64_t d = 0; d < D; d += LANES)
    simd::istore_i8_saturated(row + d, simd::iclamp(simd::to_int(simd::mul(simd::load(x + d), inv)), -127, 127));
  std::memcpy(row + D, &scale, sizeof scale);
}

}  // namespace

void quantize_kv_slot(const float* x, int64_t heads, int64_t D, int8_t* slot) {
  for (int64_t h = 0; h < heads; ++h) quantize_kv_row(x + h * D, D, slot + h * (D + INT8_SCALE_BYTES));
}

void write_kv_int8_(const at::Tensor& pool, const at::Tensor& slots, const at::Tensor& rows) {
  TORCH_CHECK(pool.device().is_cpu() && pool.scalar_type() == at::kChar && pool.dim() == 4 && pool.is_contiguous(),
              "pool must be a contiguous int8 [num_blocks, block_size, KVH, D + 4] CPU tensor");
  const int64_t KVH = pool.size(2), D = kv_pool_head_dim(pool), num_slots = pool.size(0) * pool.size(1);
  TORCH_CHECK(D > 0 && D % LANES == 0, "int8 K/V rows need head_dim a multiple of ", LANES, ", got ", D);
  TORCH_CHECK(rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.dim() == 3 && rows.size(1) == KVH &&
                  rows.size(2) == D,
              "rows must be a contiguous float32 [T, ", KVH, ", ", D, "] tensor");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == rows.size(0),
              "slots must be int64, one per row");
  const auto slot = slots.contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  const float* xp = rows.data_ptr<float>();
  int8_t* dst = pool.data_ptr<int8_t>();
  for (int64_t t = 0; t < rows.size(0); ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
    quantize_kv_slot(xp + t * KVH * D, KVH, D, dst + sp[t] * KVH * pool.size(3));
  }
}

void paged_attention_into(const AttentionPlan& plan, const float* q, int64_t q_stride, int64_t H,
                          const at::Tensor& k_cache, const at::Tensor& v_cache, float* out, double scale,
                          const Team* team, std::atomic<int64_t>* next) {
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2), D = kv_pool_head_dim(k_cache);
  const Problem pb{q,
                   q_stride,
                   k_cache.data_ptr(),
                   v_cache.data_ptr(),
                   plan.block_tables,
                   plan.max_blocks,
                   out,
                   plan.num_tokens,
                   static_cast<int>(H),
                   static_cast<int>(KVH),
                   static_cast<int>(D),
                   static_cast<int>(k_cache.size(3)),
                   static_cast<int>(H / KVH),
                   static_cast<int>(bs),
                   static_cast<float>(scale),
                   static_cast<int>(plan.sliding_window)};
  std::atomic<int64_t> own{0};
  std::atomic<int64_t>& counter = next != nullptr ? *next : own;
  if (k_cache.scalar_type() == at::kFloat)
    run<float>(pb, plan, team, counter);
  else if (k_cache.scalar_type() == at::kChar)
    run<int8_t>(pb, plan, team, counter);
  else
    run<uint16_t>(pb, plan, team, counter);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  // q may be a view of the fused qkv projection's output: rows apart, each row [H, D] dense.
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && (q.size(2) == 1 || q.stride(2) == 1) &&
                  (q.size(1) == 1 || q.stride(1) == q.size(2)),
              "q must be a float32 [T, H, D] tensor with dense rows");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, KVH, D] tensors of one dtype");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16 ||
                  k_cache.scalar_type() == at::kChar,
              "the cache must be float32, bfloat16 or int8");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(kv_pool_head_dim(k_cache) == D, "cache head_dim ", kv_pool_head_dim(k_cache), " != q head_dim ", D);
  TORCH_CHECK(k_cache.scalar_type() != at::kChar || D % LANES == 0, "int8 K/V rows need head_dim a multiple of ",
              LANES, ", got ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads ", H, " is not a multiple of num_kv_heads ", KVH);
  TORCH_CHECK(D > 0 && bs > 0, "empty head_dim or block_size");
  thread_local AttentionPlan plan;  // its tile list is reused across calls
  plan_attention(plan, block_tables, query_start_loc, seq_lens, T, H, KVH, D, num_blocks, bs, sliding_window);
  auto out = at::empty({T, H, D}, q.options());
  if (T == 0) return out;
  paged_attention_into(plan, q.data_ptr<float>(), q.size(0) > 1 ? q.stride(0) : H * D, H, k_cache, v_cache,
                       out.data_ptr<float>(), scale, nullptr, nullptr);
  return out;
}

}  // namespace protoserve
