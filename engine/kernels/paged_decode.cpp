#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace paged {

// A vector of D values as fp32: bf16 and int8 are widened into a buffer, fp32 is read where it lies.
template <typename T, int D>
struct AsFloat {
  float data[D];
  const float* operator()(const T* p) {
    for (int d = 0; d < D; ++d) data[d] = static_cast<float>(p[d]);
    return data;
  }
};
template <int D>
struct AsFloat<float, D> {
  const float* operator()(const float* p) { return p; }
};
#if defined(__F16C__)
// fp16 widened 8 at a time (vcvtph2ps): exact, the same values static_cast gives.
template <int D>
struct AsFloat<at::Half, D> {
  alignas(32) float data[D];
  const float* operator()(const at::Half* p) {
    int d = 0;
    for (; d + 8 <= D; d += 8)
      _mm256_store_ps(data + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + d))));
    for (; d < D; ++d) data[d] = static_cast<float>(p[d]);
    return data;
  }
};
#endif

// Dot product in 16 running sums folded by a fixed pairwise tree: it vectorises without -ffast-math,
// and its order never changes, so the same inputs give the same bits.
template <int D>
static inline float dot(const float* a, const float* b) {
  constexpr int W = D < 16 ? D : 16;
  float lane[W];
  for (int l = 0; l < W; ++l) lane[l] = a[l] * b[l];
  for (int c = W; c < D; c += W)
    for (int l = 0; l < W; ++l) lane[l] += a[c + l] * b[c + l];
#pragma GCC unroll 8
  for (int w = W / 2; w > 0; w /= 2)
#pragma GCC unroll 16
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

// exp(x) in plain arithmetic, so a loop over it vectorises (libm's expf is a call per value):
// x = n ln2 + r with |r| <= ln2/2, exp(r) by Cephes' degree-7 polynomial, 2^n written into the exponent.
// The softmax (x <= 0) and SwiGLU's silu (layer_stack.cpp) share it.
inline float exp_clamped(float x) {
  // Every multiply-add is an explicit fma, so a value gets the same bits in a loop's vector body and in
  // its scalar head or tail (where a row of scores starts depends on the task's shape).
  // exp(-87) ~ 1.6e-38: a weight that small counts as nothing either way; exp(88) still fits a float
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(std::fma(x, 1.44269504088896341f, 0.5f));
  const float r = std::fma(n, 2.12194440e-4f, std::fma(-n, 0.693359375f, x));
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// Calls fn(t0, rows, count, next) for each block of one question's positions t0 .. t0 + count - 1 from the
// block holding position `from` on (0 but under a sliding window), `rows`
// pointing at position t0's vector for KV head h0 in `cache` ([slots, kv_heads, D]); the block's rows
// follow at `stride`. `next` points the same way into the question's next block, and after the last
// one at `then` (what the task reads next, or nullptr): its rows are fetched while this block's are
// used, a row's lines for each row used (blocks lie anywhere in the pool, so the hardware's own
// prefetcher cannot run ahead across them).
template <typename T, typename Fn>
static inline void each_block(const T* cache, int64_t offset, const int64_t* blocks, int64_t from, int64_t len,
                              int64_t block_size, int64_t stride, const T* then, Fn&& fn) {
  for (int64_t t0 = from / block_size * block_size; t0 < len; t0 += block_size) {
    const int64_t b = t0 / block_size;
    const T* next = t0 + block_size < len ? cache + blocks[b + 1] * block_size * stride + offset : then;
    fn(t0, cache + blocks[b] * block_size * stride + offset, std::min(block_size, len - t0), next);
  }
}

// Ask for one D-vector's cache lines (a row of the next block, needed one block from now).
template <typename T, int D>
static inline void fetch_row(const T* row) {
  if (row == nullptr) return;
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < D * static_cast<int64_t>(sizeof(T)); i += 64) {
#if defined(__x86_64__)
    asm volatile("prefetcht0 %0" : : "m"(bytes[i]));  // GCC 12 at -O2 drops __builtin_prefetch here
#else
    __builtin_prefetch(bytes + i);
#endif
  }
}

// Up to 16 rows of a block as fp32 (widened once, fp32 read in place), the same rows of the next block
// fetched meanwhile.
template <typename T, int D>
static inline void widen_rows(const T* rows, const T* next, int64_t stride, int64_t count, AsFloat<T, D> (&widen)[16],
                              const float* (&out)[16]) {
  for (int64_t j = 0; j < count; ++j) {
    fetch_row<T, D>(next ? next + j * stride : nullptr);
    out[j] = widen[j](rows + j * stride);
  }
}

// Largest and sum of a row of scores, 16 lanes at a time: a chain of scalar max or add instructions
// would wait on each other's latency. The lanes fold by a fixed tree, and where a row's values fall
// among the lanes depends on its length alone, so the same row gives the same bits in any task.
static inline float lanes_max(const float* row, int64_t len) {
  float lane[16];
  for (int l = 0; l < 16; ++l) lane[l] = row[0];
  int64_t t = 0;
  for (; t + 16 <= len; t += 16)
    for (int l = 0; l < 16; ++l) lane[l] = lane[l] < row[t + l] ? row[t + l] : lane[l];
  for (int l = 0; t + l < len; ++l) lane[l] = lane[l] < row[t + l] ? row[t + l] : lane[l];
  for (int w = 8; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] = lane[l] < lane[l + w] ? lane[l + w] : lane[l];
  return lane[0];
}

static inline float lanes_sum(const float* row, int64_t len) {
  float lane[16] = {};
  int64_t t = 0;
  for (; t + 16 <= len; t += 16)
    for (int l = 0; l < 16; ++l) lane[l] += row[t + l];
  for (int l = 0; t + l < len; ++l) lane[l] += row[t + l];
  for (int w = 8; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

#if defined(__AVX512F__)
#include <immintrin.h>
// The lane sums of 16 vectors at once: element j of the result is v[j]'s 16 lanes added up. Folding
// one vector at a time costs a chain of shuffles and adds per key; folding 16 together shares them.
// Each key's lanes are added in one fixed tree, whatever the other 15 hold (zeros for a short block).
// The tree's first half needs only four keys (quad_sums), so a caller may fold keys four at a time and
// finish the 16 later (lanes_of_quads): the same instructions on the same values, the same bits.
static inline __m512 quad_sums(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  // per 128-bit lane: keys 2i and 2i+1, elements (0+2) and (1+3); then keys 4i .. 4i+3, that lane's sum
  const __m512 low = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
  const __m512 high = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
  const __m512d x = _mm512_castps_pd(low), y = _mm512_castps_pd(high);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// Across the four 128-bit lanes of four quads: (lanes 0+1) + (lanes 2+3), landing keys 4i .. 4i+3 in lane i.
static inline __m512 lanes_of_quads(__m512 q0, __m512 q1, __m512 q2, __m512 q3) {
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(q0, q1, 0x88), _mm512_shuffle_f32x4(q0, q1, 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(q2, q3, 0x88), _mm512_shuffle_f32x4(q2, q3, 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

static inline __m512 lane_sums16(const __m512 (&v)[16]) {
  return lanes_of_quads(quad_sums(v[0], v[1], v[2], v[3]), quad_sums(v[4], v[5], v[6], v[7]),
                        quad_sums(v[8], v[9], v[10], v[11]), quad_sums(v[12], v[13], v[14], v[15]));
}
#endif

#if defined(__AVX512F__)
// 16 values of a cached row as fp32; bf16 is the top half of an fp32, so widening is exact.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 load16(const at::Half* p) {  // exact: every fp16 is an fp32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline __m512 load16(const int8_t* p) {  // exact: every int8 is an fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// acc[g * D ..] += weight[g * len + t0 + j] * value row j, for a block's `count` rows in order. The G x D
// sums are vector variables, so they stay in registers; as a plain float array GCC kept them on the stack
// and every row paid a store and a reload per sum. Each sum is one fma per row, as before: same bits.
template <typename T, int D, int G>
static inline void add_values(const T* rows, const T* next, int64_t stride, int64_t count, const float* weight,
                              int64_t len, int64_t t0, float* acc) {
  constexpr int C = D / 16;
  __m512 sum[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) sum[g][c] = _mm512_loadu_ps(acc + g * D + c * 16);
  for (int64_t j = 0; j < count; ++j) {
    fetch_row<T, D>(next ? next + j * stride : nullptr);
    __m512 value[C];
    for (int c = 0; c < C; ++c) value[c] = load16(rows + j * stride + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(weight[g * len + t0 + j]);
      for (int c = 0; c < C; ++c) sum[g][c] = _mm512_fmadd_ps(p, value[c], sum[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + c * 16, sum[g][c]);
}
#endif

#if defined(__AVX512F__)
// One key's 16 lane products of q . k, summed over D / 16 vectors in order (lane_sums16 folds them).
template <int D>
static inline __m512 key_dot(const __m512 (&q)[D / 16], const float* key) {
  __m512 lanes = _mm512_mul_ps(q[0], _mm512_loadu_ps(key));
  for (int c = 1; c < D / 16; ++c) lanes = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(key + c * 16), lanes);
  return lanes;
}
#endif

#if defined(__AVX512F__)
// Registers for the G query heads' vectors in score_keys_shared: with G x 4 lanes, a key and temporaries,
// more would spill.
constexpr int SHARED_KEY_REGS = 12;

// The pass both grouped score paths make over up to 16 keys for G query heads, each key read once for
// the G of them: key_lanes(j, lanes) gives key j's 16 lane products per head, finish() turns a folded
// score into the stored one. Keys go four at a time through the first half of the fold, so only G x 4
// lane vectors are live, not G x 16; the same operations in the same order: same bits.
template <int G, typename KeyLanes, typename Finish>
static inline void fold_scores(int64_t count, float* out, int64_t len, KeyLanes&& key_lanes, Finish&& finish) {
  alignas(64) float quads[G][4][16];  // the fold's halfway sums, kept in L1: registers hold q and keys
#pragma GCC unroll 4
  for (int four = 0; four < 4; ++four) {
    __m512 v[G][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const int64_t j = four * 4 + i;
      __m512 lanes[G];
      if (j < count) {
        key_lanes(j, lanes);
      } else {
        for (int g = 0; g < G; ++g) lanes[g] = _mm512_setzero_ps();
      }
      for (int g = 0; g < G; ++g) v[g][i] = lanes[g];
    }
    for (int g = 0; g < G; ++g) _mm512_store_ps(quads[g][four], quad_sums(v[g][0], v[g][1], v[g][2], v[g][3]));
  }
  for (int g = 0; g < G; ++g)
    _mm512_mask_storeu_ps(out + g * len, static_cast<__mmask16>((1u << count) - 1),
                          finish(lanes_of_quads(_mm512_load_ps(quads[g][0]), _mm512_load_ps(quads[g][1]),
                                                _mm512_load_ps(quads[g][2]), _mm512_load_ps(quads[g][3]))));
}

// score_keys for all G query heads in one pass, where the G heads' D values fit in registers: each key
// is loaded (and widened) once for the G of them.
template <typename T, int D, int G>
static inline void score_keys_shared(const float* query, const T* rows, const T* next, int64_t stride,
                                     int64_t count, float* out, int64_t len) {
  constexpr int C = D / 16;
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_ps(query + g * D + c * 16);
  fold_scores<G>(count, out, len, [&](int64_t j, __m512 (&lanes)[G]) {
    fetch_row<T, D>(next ? next + j * stride : nullptr);
    __m512 key[C];
    for (int c = 0; c < C; ++c) key[c] = load16(rows + j * stride + c * 16);
    for (int g = 0; g < G; ++g) {
      lanes[g] = _mm512_mul_ps(qv[g][0], key[0]);
      for (int c = 1; c < C; ++c) lanes[g] = _mm512_fmadd_ps(qv[g][c], key[c], lanes[g]);
    }
  }, [](__m512 score) { return score; });
}
#endif

#if defined(__AVX512BF16__)
// Where a bf16 cache's scores take vdpbf16ps: the G heads' bf16 query vectors fit in registers.
template <typename T, typename C, int D, int G>
constexpr bool BF16_SCORES = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> && D % 32 == 0 &&
                             G * (D / 32) <= SHARED_KEY_REGS;

// score_keys_shared for bf16 queries and keys on CPUs with AVX512_BF16: one vdpbf16ps adds two products
// of bf16 values (exact in fp32) per lane, so a key takes D / 32 instructions per head, not D / 16, and
// keys are never widened. The query is the model's own bf16 values; scale multiplies each finished score.
template <int D, int G>
static inline void score_keys_bf16(const c10::BFloat16* query, const c10::BFloat16* rows, const c10::BFloat16* next,
                                   int64_t stride, int64_t count, float scale, float* out, int64_t len) {
  constexpr int C = D / 32;
  __m512bh qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(query + g * D + c * 32);
  const __m512 scales = _mm512_set1_ps(scale);
  fold_scores<G>(count, out, len, [&](int64_t j, __m512 (&lanes)[G]) {
    fetch_row<c10::BFloat16, D>(next ? next + j * stride : nullptr);
    __m512bh key[C];
    for (int c = 0; c < C; ++c) key[c] = (__m512bh)_mm512_loadu_si512(rows + j * stride + c * 32);
    for (int g = 0; g < G; ++g) {
      lanes[g] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], key[0]);
      for (int c = 1; c < C; ++c) lanes[g] = _mm512_dpbf16_ps(lanes[g], qv[g][c], key[c]);
    }
  }, [&](__m512 score) { return _mm512_mul_ps(score, scales); });
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define KEV_AVX2_ATTENTION 1
// CPUs with AVX2 but not AVX-512 (the generic loops below folded each key's 16 lanes on its own, a chain
// of shuffles per key and head, and kept a head's value sums on the stack).

// One key's 8 lane products of q . k, summed over D / 8 vectors in order.
template <int D>
static inline __m256 key_dot8(const __m256 (&q)[D / 8], const float* key) {
  __m256 lanes = _mm256_mul_ps(q[0], _mm256_loadu_ps(key));
  for (int c = 1; c < D / 8; ++c) lanes = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(key + c * 8), lanes);
  return lanes;
}

// Element i: v[i]'s 8 lanes added up, ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) for every key
// wherever it sits among the 8, so a key's score never depends on its neighbours (zeros past a block's end).
static inline __m256 lane_sums8(const __m256 (&v)[8]) {
  __m256 pair[4];  // keys 2i and 2i + 1: lanes l + (l + 4), one key per 128-bit half
  for (int i = 0; i < 4; ++i)
    pair[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                            _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  // adjacent lanes twice: halves hold keys (0, 2, 4, 6) and (1, 3, 5, 7), then back into key order
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(pair[0], pair[1]), _mm256_hadd_ps(pair[2], pair[3]));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The first n (1..8) elements of v to out.
static inline void store_first(float* out, __m256 v, int64_t n) {
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  _mm256_maskstore_ps(out, mask, v);
}

// Scores of up to 16 keys for G query heads, each key widened once for the G of them; a head's D query
// values stay in registers across the keys.
template <typename T, int D, int G>
static inline void score_keys8(const float* query, const T* rows, const T* next, int64_t stride, int64_t count,
                               float* out, int64_t len) {
  AsFloat<T, D> widen[16];
  const float* key[16];
  widen_rows<T, D>(rows, next, stride, count, widen, key);
  for (int g = 0; g < G; ++g) {
    __m256 qv[D / 8];
    for (int c = 0; c < D / 8; ++c) qv[c] = _mm256_loadu_ps(query + g * D + c * 8);
    for (int64_t j0 = 0; j0 < count; j0 += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = j0 + i < count ? key_dot8<D>(qv, key[j0 + i]) : _mm256_setzero_ps();
      store_first(out + g * len + j0, lane_sums8(v), std::min<int64_t>(8, count - j0));
    }
  }
}

// acc[g * D ..] += weight[g * len + t0 + j] * value row j, rows in order, one fma per sum and row; a head's
// D sums stay in registers over up to 16 rows, widened once for the G heads.
template <typename T, int D, int G>
static inline void add_values8(const T* rows, const T* next, int64_t stride, int64_t count, const float* weight,
                               int64_t len, int64_t t0, float* acc) {
  AsFloat<T, D> widen[16];
  const float* value[16];
  for (int64_t j0 = 0; j0 < count; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, count - j0);
    widen_rows<T, D>(rows + j0 * stride, next ? next + j0 * stride : nullptr, stride, n, widen, value);
    for (int g = 0; g < G; ++g) {
      __m256 sum[D / 8];
      for (int c = 0; c < D / 8; ++c) sum[c] = _mm256_loadu_ps(acc + g * D + c * 8);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 p = _mm256_set1_ps(weight[g * len + t0 + j0 + j]);
        for (int c = 0; c < D / 8; ++c) sum[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value[j] + c * 8), sum[c]);
      }
      for (int c = 0; c < D / 8; ++c) _mm256_storeu_ps(acc + g * D + c * 8, sum[c]);
    }
  }
}
#endif

// Scores of up to 16 consecutive keys (rows `stride` apart) for G query heads: out[g * len + j].
template <typename T, int D, int G, typename Widen>
static inline void score_keys(const float* query, const T* rows, const T* next, int64_t stride, int64_t count,
                              float* out, int64_t len, Widen& as_float) {
#if defined(__AVX512F__)
  if constexpr (D % 16 == 0 && G * (D / 16) <= SHARED_KEY_REGS) {
    score_keys_shared<T, D, G>(query, rows, next, stride, count, out, len);
    return;
  } else if constexpr (D % 16 == 0) {
    AsFloat<T, D> widen[16];  // each key widened once for all G query heads
    const float* key[16];
    widen_rows<T, D>(rows, next, stride, count, widen, key);
    // The query head's D values stay in registers across the 16 keys: GCC otherwise reloads them for
    // every key, and the loads, not the multiplies, set the pace (a 1,000-token prompt's attention took
    // 1.2x as long). Same operations in the same order: same bits.
    for (int g = 0; g < G; ++g) {
      __m512 qv[D / 16];
      for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(query + g * D + c * 16);
      __m512 v[16];
      if (count == 16) {  // a whole block: no test per key
        for (int64_t j = 0; j < 16; ++j) v[j] = key_dot<D>(qv, key[j]);
      } else {
        for (int64_t j = 0; j < 16; ++j) v[j] = j < count ? key_dot<D>(qv, key[j]) : _mm512_setzero_ps();
      }
      _mm512_mask_storeu_ps(out + g * len, static_cast<__mmask16>((1u << count) - 1), lane_sums16(v));
    }
    return;
  }
#elif defined(KEV_AVX2_ATTENTION)
  if constexpr (D % 8 == 0) {
    score_keys8<T, D, G>(query, rows, next, stride, count, out, len);
    return;
  }
#endif
  for (int64_t j = 0; j < count; ++j) {
    fetch_row<T, D>(next ? next + j * stride : nullptr);
    const float* key = as_float(rows + j * stride);
    for (int g = 0; g < G; ++g) out[g * len + j] = dot<D>(query + g * D, key);
  }
}

// Multiplies each of a KV head's G rows of per-position weights by that position's int8 scale, in place.
static inline void apply_scales(float* rows, const at::Half* scales, const int64_t* blocks, int64_t first, int64_t len,
                                int64_t block_size, int64_t kv_heads, int64_t head, int G) {
  for (int64_t t = first; t < len; ++t) {
    const float s = static_cast<float>(scales[(blocks[t / block_size] * block_size + t % block_size) * kv_heads + head]);
    for (int g = 0; g < G; ++g) rows[g * len + t] *= s;
  }
}

// One task: KV heads [h0, h1) of question b. Each query head's scores, softmax and weighted sum are
// computed in the same order whichever heads share its task, so a row's bits do not depend on how the
// step was split. D (head size) and G (query heads per KV head) are compile-time constants, so every
// loop over D vectorises. T is the queries' and the output's type, C the cache's: T itself, or int8 with
// one fp16 scale per position and KV head in k_scales / v_scales (nullptr otherwise).
template <typename T, typename C, int D, int G>
static void decode_task(const T* q, const C* k, const C* v, const at::Half* k_scales, const at::Half* v_scales,
                        const int64_t* blocks, int64_t len, T* out, int64_t b, int64_t h0, int64_t h1, int64_t heads,
                        int64_t kv_heads, int64_t block_size, float scale, int64_t window, float softcap,
                        std::vector<float>& buffer) {
  const int64_t n = (h1 - h0) * G;  // query heads in this task
  // A sliding window (window > 0) hides the keys before `first`: blocks wholly before it are never read,
  // and the keys of `first`'s block before it weigh exactly zero (fma adds nothing), so a row's sums are
  // the ones a plain row over keys `first`.. would give, whatever its position in its block.
  const int64_t first = window > 0 && len > window ? len - window : 0;
  buffer.resize(n * (len + 2 * D + 1));
  float* query = buffer.data();      // [n, D]
  float* acc = query + n * D;        // [n, D]
  float* scores = acc + n * D;       // [n, len]
  float* total = scores + n * len;   // [n]
  const int64_t first_head = b * heads + h0 * G, stride = kv_heads * D;
  for (int64_t i = 0; i < n * D; ++i) query[i] = static_cast<float>(q[first_head * D + i]) * scale;
  AsFloat<C, D> as_float;
  // Block by block (16 positions of every KV head lie together, read once from memory, then from L1 for
  // each head), 16 keys at a time for a KV head's G query heads.
  // The keys, then the values: the first value block is fetched during the last key block.
  each_block(k, h0 * D, blocks, first, len, block_size, stride,
             v + blocks[first / block_size] * block_size * stride + h0 * D,
             [&](int64_t t0, const C* rows, int64_t count, const C* next) {
    for (int64_t h = 0; h < h1 - h0; ++h)
      for (int64_t j = 0; j < count; j += 16) {
#if defined(__AVX512BF16__)
        if constexpr (BF16_SCORES<T, C, D, G>) {
          score_keys_bf16<D, G>(q + (first_head + h * G) * D, rows + j * stride + h * D,
                                next ? next + j * stride + h * D : nullptr, stride, std::min<int64_t>(16, count - j),
                                scale, scores + h * G * len + t0 + j, len);
          continue;
        }
#endif
        score_keys<C, D, G>(query + h * G * D, rows + j * stride + h * D, next ? next + j * stride + h * D : nullptr,
                            stride, std::min<int64_t>(16, count - j), scores + h * G * len + t0 + j, len, as_float);
      }
  });
  if (k_scales != nullptr)  // q . (s k) = s (q . k): one multiply per key, not D
    for (int64_t h = 0; h < h1 - h0; ++h)
      apply_scales(scores + h * G * len, k_scales, blocks, first, len, block_size, kv_heads, h0 + h, G);
  for (int64_t i = 0; i < n; ++i) {
    float* row = scores + i * len;
    if (softcap > 0.f)  // Gemma 2: scores squashed into (-softcap, softcap) before the softmax
      for (int64_t t = first; t < len; ++t) row[t] = std::tanh(row[t] / softcap) * softcap;
    const float top = lanes_max(row + first, len - first);
#pragma omp simd
    for (int64_t t = first; t < len; ++t) row[t] = exp_clamped(row[t] - top);
    std::fill(row, row + first, 0.f);
    total[i] = lanes_sum(row + first, len - first);
  }
  if (v_scales != nullptr)  // the weights, not yet normalised, carry each value's scale
    for (int64_t h = 0; h < h1 - h0; ++h)
      apply_scales(scores + h * G * len, v_scales, blocks, first, len, block_size, kv_heads, h0 + h, G);
  std::fill(acc, acc + n * D, 0.f);
  // A KV head's G x D sums stay in registers over a block; each still adds positions in order.
  each_block(v, h0 * D, blocks, first, len, block_size, stride, static_cast<const C*>(nullptr),
             [&](int64_t t0, const C* rows, int64_t count, const C* next) {
    for (int64_t h = 0; h < h1 - h0; ++h) {
      float* a = acc + h * G * D;
#if defined(__AVX512F__)
      if constexpr (D % 16 == 0) {
        add_values<C, D, G>(rows + h * D, next ? next + h * D : nullptr, stride, count, scores + h * G * len, len,
                            t0, a);
        continue;
      }
#elif defined(KEV_AVX2_ATTENTION)
      if constexpr (D % 8 == 0) {
        add_values8<C, D, G>(rows + h * D, next ? next + h * D : nullptr, stride, count, scores + h * G * len, len,
                             t0, a);
        continue;
      }
#endif
      float sum[G][D];
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) sum[g][d] = a[g * D + d];
      for (int64_t j = 0; j < count; ++j) {
        fetch_row<C, D>(next ? next + j * stride + h * D : nullptr);
        const float* value = as_float(rows + j * stride + h * D);
        for (int g = 0; g < G; ++g) {
          const float p = scores[(h * G + g) * len + t0 + j];
#pragma omp simd
          for (int d = 0; d < D; ++d) sum[g][d] += p * value[d];
        }
      }
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) a[g * D + d] = sum[g][d];
    }
  });
  for (int64_t i = 0; i < n; ++i)
    for (int d = 0; d < D; ++d) out[(first_head + i) * D + d] = static_cast<T>(acc[i * D + d] / total[i]);
}

// Tasks are handed out one at a time (rows differ in length, so equal shares of rows are not equal
// shares of work). With enough rows a task is a whole question, which reads its slots in order; with
// few, each KV head is its own task so every thread has work.
template <typename T, typename C, int D, int G>
static void decode_rows(const T* q, const C* k, const C* v, const at::Half* k_scales, const at::Half* v_scales,
                        const int64_t* table, const int64_t* lengths, T* out, int64_t batch, int64_t heads,
                        int64_t kv_heads, int64_t max_blocks, int64_t block_size, float scale, int64_t window,
                        float softcap) {
  const int64_t threads = at::get_num_threads();
  const int64_t per_task = batch >= 4 * threads ? kv_heads : 1;
  const int64_t tasks = batch * (kv_heads / per_task);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> buffer;
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t b = task / (kv_heads / per_task), h0 = task % (kv_heads / per_task) * per_task;
      decode_task<T, C, D, G>(q, k, v, k_scales, v_scales, table + b * max_blocks, lengths[b], out, b, h0,
                              h0 + per_task, heads, kv_heads, block_size, scale, window, softcap, buffer);
    }
  });
}

template <typename T, typename C>
static bool dispatch(const T* q, const C* k, const C* v, const at::Half* k_scales, const at::Half* v_scales,
                     const int64_t* table, const int64_t* lengths, T* out, int64_t batch, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t max_blocks, int64_t block_size, float scale,
                     int64_t window, float softcap) {
#define KEV_CASE(DIM, GROUP)                                                                           \
  if (dim == DIM && heads == GROUP * kv_heads) {                                                       \
    decode_rows<T, C, DIM, GROUP>(q, k, v, k_scales, v_scales, table, lengths, out, batch, heads, kv_heads,   \
                                  max_blocks, block_size, scale, window, softcap);                     \
    return true;                                                                                       \
  }
#define KEV_DIM(DIM) KEV_CASE(DIM, 1) KEV_CASE(DIM, 2) KEV_CASE(DIM, 3) KEV_CASE(DIM, 4) KEV_CASE(DIM, 8)
  KEV_DIM(16) KEV_DIM(32) KEV_DIM(64) KEV_DIM(128) KEV_DIM(256)
  // The Qwen2.5 family's groups (0.5B: 14 heads over 2, 7B: 28 over 4; 1.5B: 6; 14B and 32B: 5), at its head sizes.
  KEV_CASE(64, 5) KEV_CASE(64, 6) KEV_CASE(64, 7) KEV_CASE(128, 5) KEV_CASE(128, 6) KEV_CASE(128, 7)
#undef KEV_DIM
#undef KEV_CASE
  return false;
}

// Without the GIL: the caller (paged_decode below, or the layer stack) has released it.
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& table,
                     const torch::Tensor& lengths, int64_t block_size, double scale, int64_t window, double softcap,
                     const c10::optional<torch::Tensor>& k_scales, const c10::optional<torch::Tensor>& v_scales) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && table.device().is_cpu() &&
              lengths.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.size(2) == q.size(2),
              "paged_decode: q [B, H, D], k and v [slots, KVH, D]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous());
  const bool int8 = k.scalar_type() == at::ScalarType::Char;
  // an fp16 cache under fp32 queries: kv_cache.dtype fp16, half the bytes of the model's fp32
  const bool half = k.scalar_type() == at::ScalarType::Half && q.scalar_type() == at::ScalarType::Float;
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && (int8 || half || k.scalar_type() == q.scalar_type()),
              "paged_decode: k and v of q's dtype, fp16 under fp32 queries, or int8");
  TORCH_CHECK(int8 == (k_scales.has_value() && v_scales.has_value()), "paged_decode: an int8 cache needs its scales");
  if (int8)
    for (const auto& s : {*k_scales, *v_scales})
      TORCH_CHECK(s.scalar_type() == at::ScalarType::Half && s.is_contiguous() && s.dim() == 2 &&
                  s.size(0) == k.size(0) && s.size(1) == k.size(1), "paged_decode: scales [slots, KVH], fp16");
  TORCH_CHECK(table.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong && table.dim() == 2 &&
              lengths.dim() == 1 && table.size(0) == q.size(0) && lengths.size(0) == q.size(0),
              "paged_decode: table [B, blocks] and lengths [B], int64");
  TORCH_CHECK(block_size > 0 && k.size(0) % block_size == 0);
  auto table_c = table.contiguous();
  auto lengths_c = lengths.contiguous();
  // Every row reads only its own blocks: its length fits its table, its block ids lie in the pool.
  const int64_t num_blocks = k.size(0) / block_size, width = table_c.size(1);
  const int64_t* table_p = table_c.data_ptr<int64_t>();
  const int64_t* lengths_p = lengths_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lengths_p[b] >= 1 && lengths_p[b] <= width * block_size, "paged_decode: row ", b, " has length ",
                lengths_p[b], " for ", width, " blocks of ", block_size);
    for (int64_t i = 0; i < (lengths_p[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table_p[b * width + i] >= 0 && table_p[b * width + i] < num_blocks, "paged_decode: row ", b,
                  " names block ", table_p[b * width + i], " of ", num_blocks);
  }
  auto out = torch::empty_like(q);
  bool done = false;
  const at::Half* k_scales_p = int8 ? k_scales->data_ptr<at::Half>() : nullptr;
  const at::Half* v_scales_p = int8 ? v_scales->data_ptr<at::Half>() : nullptr;
  auto launch = [&](auto zero, auto cache_zero) {
    using T = decltype(zero);
    using C = decltype(cache_zero);
    done = dispatch<T, C>(q.data_ptr<T>(), k.data_ptr<C>(), v.data_ptr<C>(), k_scales_p, v_scales_p, table_p,
                          lengths_p, out.data_ptr<T>(), q.size(0), q.size(1), k.size(1), q.size(2), width, block_size,
                          static_cast<float>(scale), window, static_cast<float>(softcap));
  };
  if (half) launch(float{}, at::Half{});
  else if (q.scalar_type() == at::ScalarType::Float) int8 ? launch(float{}, int8_t{}) : launch(float{}, float{});
  else if (q.scalar_type() == at::ScalarType::BFloat16)
    int8 ? launch(c10::BFloat16{}, int8_t{}) : launch(c10::BFloat16{}, c10::BFloat16{});
  TORCH_CHECK(done, "paged_decode: no kernel for head size ", q.size(2), " with ", q.size(1), " heads over ",
              k.size(1), " KV heads");
  return out;
}

}  // namespace paged

// window: keys a row sees, counting its own (0: all); softcap: tanh cap on the scores (0: none).
// k_scales, v_scales: [slots, KVH] fp16, for an int8 cache only.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor table,
                           torch::Tensor lengths, int64_t block_size, double scale, int64_t window, double softcap,
                           c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales) {
  pybind11::gil_scoped_release no_gil;  // other Python threads (the worker's event loop) run meanwhile
  return paged::attend(q, k, v, table, lengths, block_size, scale, window, softcap, k_scales, v_scales);
}
