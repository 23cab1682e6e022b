// GGUF's block formats for block_linear.cpp: their layouts, a row of activations as int8 codes, a weight
// group decoded (plain C++ and AVX2), the float steps every path shares, and one row's dot product (a decode
// step). Compiled with block_woven.cpp and block_linear.cpp, in that order, as one translation unit (native.py).

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

namespace block_kernels {

constexpr int QB = 32;            // a block of the row's codes
constexpr int GROUP = 8 * QB;     // eight blocks: one lane each

// ggml's type ids.
enum Format : int64_t { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline int64_t block_elems(int64_t f) { return f >= Q4_K ? 256 : 32; }
inline int64_t block_bytes(int64_t f) {
  switch (f) {
    case Q4_0: return 18;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
  }
  TORCH_CHECK(false, "block_linear: format ", f, " is not one Kev runs as stored");
  return 0;
}

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // exact, as the software conversion below
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// A row's codes: K int8 (groups padded with zeros), and per block its scale, code sum and scale * sum.
struct Codes {
  int8_t* q;
  float* scale;
  int32_t* sum;
  float* scaled_sum;
  int64_t stride, blocks;  // q's row stride; blocks per row, padded to whole groups
  const struct RowGroup* woven = nullptr;  // many rows: [group][row] records (below)
  int64_t rows = 0;
};

// Many rows (block_woven.cpp): one row's codes for one group, woven as weave_codes lays them out, with the
// group's eight block scales, code sums, scaled sums and (Q6_K) the sums of each block's two 16-code
// halves. A group's records for every row lie one after another, so a chunk of rows reads them straight
// through: read at the row stride, a chunk's codes for one group fell into a quarter of L1's sets.
struct RowGroup {
  alignas(32) int8_t codes[GROUP];
  float scale[8];
  int32_t sum[8];
  float scaled_sum[8];
  int32_t halves[2][8];
};

#if defined(__AVX2__) && defined(__FMA__)
// One fp32 block as quantize_row makes it, 8 values a step: max ignores a NaN as std::max(amax, |v|) does
// (vmaxps returns its second operand), vcvtps2dq rounds to nearest even as nearbyint does here, and a NaN's
// INT_MIN clamps to -127 as static_cast's does. The same codes, scale and sums.
inline void quantize_block8(const float* x, int8_t* q, float& scale, int32_t& sum, float& scaled_sum) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + i * 8), amax = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), amax);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = 0.f;
  for (float lane : lanes) m = std::max(m, lane);
  const float d = m / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
  __m256i c[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv))), _mm256_set1_epi32(-127)),
                            _mm256_set1_epi32(127));
    total = _mm256_add_epi32(total, c[i]);
  }
  // int32 -> int8 in order: packs work within 128-bit lanes, the permute puts the lanes back in order
  const __m256i words = _mm256_packs_epi32(c[0], c[1]), words2 = _mm256_packs_epi32(c[2], c[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  alignas(32) int32_t parts[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(parts), total);
  int32_t t = 0;
  for (int32_t part : parts) t += part;
  scale = d, sum = t, scaled_sum = d * static_cast<float>(t);
}
#endif

template <typename X>
void quantize_row(const X* x, int64_t k, int8_t* q, float* scale, int32_t* sum, float* scaled_sum, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b) {
    if (b * QB >= k) {
      std::memset(q + b * QB, 0, QB);
      scale[b] = 0.f, sum[b] = 0, scaled_sum[b] = 0.f;
      continue;
    }
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<X, float>) {
      quantize_block8(x + b * QB, q + b * QB, scale[b], sum[b], scaled_sum[b]);
      continue;
    }
#endif
    float v[QB], amax = 0.f;
    for (int i = 0; i < QB; ++i) {
      v[i] = static_cast<float>(x[b * QB + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    int32_t total = 0;
    for (int i = 0; i < QB; ++i) {
      const int32_t c = static_cast<int32_t>(std::nearbyint(v[i] * inv));
      q[b * QB + i] = static_cast<int8_t>(std::clamp(c, -127, 127));
      total += q[b * QB + i];
    }
    scale[b] = d, sum[b] = total, scaled_sum[b] = d * static_cast<float>(total);
  }
}

// One group of a weight row decoded: eight 32-code blocks as the unsigned operand `u` (signed formats:
// |w|, with `w` kept for the row codes' signs), their float scales and mins, and Q6_K's integer scale
// per four-lane half (two 16-code sub-blocks per block).
struct Group {
  alignas(32) uint8_t u[8][QB];
  alignas(32) int8_t w[8][QB];
  alignas(32) float scale[8];
  alignas(32) float min[8];
  alignas(32) int32_t lane_scale[8][8];
  int count;  // blocks present (the last group of a 32-block format may hold fewer)
};

struct Traits {
  bool is_signed, has_min, lane_scaled;
  int offset;  // codes stored offset by this (Q4_0: 8, Q5_0: 16), taken off exactly with the row's sums
};

constexpr Traits traits(int64_t f) {
  switch (f) {
    case Q8_0: return {true, false, false, 0};
    case Q4_0: return {false, false, false, 8};
    case Q5_0: return {false, false, false, 16};
    case Q4_K: return {false, true, false, 0};
    case Q5_K: return {false, true, false, 0};
    default: return {true, false, true, 0};  // Q6_K
  }
}

inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63, m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Decodes group g of `row` (K / 256 groups; for 32-block formats, blocks 8g .. 8g + 7 of `nblocks`).
inline void decode_plain(int64_t f, const uint8_t* row, int64_t g, int64_t nblocks, Group& out) {
  std::memset(out.scale, 0, sizeof out.scale);
  std::memset(out.min, 0, sizeof out.min);
  if (block_elems(f) == 32) {
    const int64_t first = g * 8;
    out.count = static_cast<int>(std::min<int64_t>(8, nblocks - first));
    const int64_t bytes = block_bytes(f);
    for (int j = 0; j < out.count; ++j) {
      const uint8_t* b = row + (first + j) * bytes;
      out.scale[j] = half(b);
      if (f == Q8_0) {
        std::memcpy(out.w[j], b + 2, QB);
        for (int i = 0; i < QB; ++i) out.u[j][i] = static_cast<uint8_t>(std::abs(static_cast<int>(out.w[j][i])));
      } else {
        const uint8_t* qs = b + (f == Q5_0 ? 6 : 2);
        uint32_t high = 0;
        if (f == Q5_0) std::memcpy(&high, b + 2, 4);
        for (int i = 0; i < 16; ++i) {
          out.u[j][i] = (qs[i] & 0xF) | (f == Q5_0 ? ((high >> i) & 1) << 4 : 0);
          out.u[j][i + 16] = (qs[i] >> 4) | (f == Q5_0 ? ((high >> (i + 16)) & 1) << 4 : 0);
        }
      }
    }
    return;
  }
  out.count = 8;
  const uint8_t* b = row + g * block_bytes(f);
  if (f == Q6_K) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < QB; ++l) {
        const uint8_t lo0 = ql[64 * h + l], lo1 = ql[64 * h + 32 + l], hi = qh[32 * h + l];
        const int codes[4] = {(lo0 & 0xF) | ((hi & 3) << 4), (lo1 & 0xF) | (((hi >> 2) & 3) << 4),
                              (lo0 >> 4) | (((hi >> 4) & 3) << 4), (lo1 >> 4) | (((hi >> 6) & 3) << 4)};
        for (int c = 0; c < 4; ++c) {
          const int v = codes[c] - 32;
          out.w[4 * h + c][l] = static_cast<int8_t>(v);
          out.u[4 * h + c][l] = static_cast<uint8_t>(std::abs(v));
        }
      }
    for (int j = 0; j < 8; ++j) {
      out.scale[j] = d;
      for (int lane = 0; lane < 8; ++lane) out.lane_scale[j][lane] = sc[2 * j + lane / 4];
    }
    return;
  }
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* s = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (f == Q5_K ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    k_scale_min(s, j, sc, m);
    out.scale[j] = d * static_cast<float>(sc);
    out.min[j] = dmin * static_cast<float>(m);
    const uint8_t* q = qs + 32 * (j / 2);
    for (int l = 0; l < QB; ++l) {
      uint8_t code = j % 2 ? q[l] >> 4 : q[l] & 0xF;
      if (f == Q5_K) code |= ((qh[l] >> j) & 1) << 4;
      out.u[j][l] = code;
    }
  }
}

// The eight lanes of a group's float chain, added in one fixed order.
inline float lanes_sum(const float* a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

#if defined(__AVX2__) && defined(__FMA__)
// lanes_sum of eight rows' accumulators (a: 8 x 8 floats), row i's in lane i: the same additions on the same
// values, only side by side (rows i and i + 4 share a register, then four registers' halves interleave).
inline __m256 lanes_sums8(const float* a) {
  __m256 half[4];  // rows i (low) and i + 4 (high): a[k] + a[k + 4] for k < 4
  for (int i = 0; i < 4; ++i) {
    const __m256 lo = _mm256_loadu_ps(a + i * 8), hi = _mm256_loadu_ps(a + (i + 4) * 8);
    half[i] = _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
  }
  // per 128-bit half: (x0 + x2) and (x1 + x3) of two rows, then of the four rows side by side
  const __m256 u = _mm256_add_ps(_mm256_unpacklo_ps(half[0], half[1]), _mm256_unpackhi_ps(half[0], half[1]));
  const __m256 v = _mm256_add_ps(_mm256_unpacklo_ps(half[2], half[3]), _mm256_unpackhi_ps(half[2], half[3]));
  const __m256d ud = _mm256_castps_pd(u), vd = _mm256_castps_pd(v);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ud, vd)), _mm256_castpd_ps(_mm256_unpackhi_pd(ud, vd)));
}

inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Lane j of the result: the sum of p[j]'s eight lanes.
inline __m256i sum_each(const __m256i* p) {
  const __m256i t0 = _mm256_hadd_epi32(p[0], p[1]), t1 = _mm256_hadd_epi32(p[2], p[3]);
  const __m256i t2 = _mm256_hadd_epi32(p[4], p[5]), t3 = _mm256_hadd_epi32(p[6], p[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}


// Group decoding with AVX2: the same codes decode_plain writes.
inline __m256i nibbles16(const uint8_t* p) {  // 16 bytes -> their low nibbles, then their high nibbles
  // Both halves hold the 16 bytes; the upper one shifted right by 4: three instructions, no lane insert.
  const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(x, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0xF));
}

inline __m256i bits_to_bytes(const uint8_t* p) {  // bit i of 32 -> byte i: 0xFF where set
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i marked = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(marked, _mm256_set1_epi64x(-1));
}

// Q5_0: a block's 32 five-bit codes, the nibbles at b + 6 and the fifth bits at b + 2. With AVX-512BW the
// bits are a mask register under which one instruction adds 0x10 to the nibbles (the same bytes).
inline __m256i q5_codes(const uint8_t* b) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  uint32_t bits;
  std::memcpy(&bits, b + 2, 4);
  const __m256i nib = nibbles16(b + 6);
  return _mm256_mask_add_epi8(nib, static_cast<__mmask32>(bits), nib, _mm256_set1_epi8(0x10));  // nib < 16: + is |
#else
  return _mm256_or_si256(nibbles16(b + 6), _mm256_and_si256(bits_to_bytes(b + 2), _mm256_set1_epi8(0x10)));
#endif
}

inline void put(void* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }

// Q6_K: half h (0 or 1) of a block's 256 6-bit codes, as four 32-byte runs (0..63; the bias of 32 not yet taken).
inline void q6k_codes(const uint8_t* b, int h, __m256i codes[4]) {
  const __m256i low4 = _mm256_set1_epi8(0xF), high2 = _mm256_set1_epi8(0x30);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
  codes[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(hi, 4), high2));
  codes[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(hi, 2), high2));
  codes[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(hi, high2));
  codes[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                             _mm256_and_si256(_mm256_srli_epi16(hi, 2), high2));
}

// k_scale_min's eight scales and eight mins at once, as int32 lanes: the twelve bytes as three words,
// the 6-bit fields gathered with masks and shifts (the same values, no per-field loads and stores).
inline void k_scales_mins(const uint8_t* s, __m256i& scales, __m256i& mins) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  const uint32_t sc_lo = w[0] & low6, m_lo = w[1] & low6;
  const uint32_t sc_hi = (w[2] & low4) | (((w[0] >> 6) & top2) << 4);
  const uint32_t m_hi = ((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4);
  scales = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(static_cast<uint64_t>(sc_hi) << 32 | sc_lo)));
  mins = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(static_cast<uint64_t>(m_hi) << 32 | m_lo)));
}

// Q4_K and Q5_K: sub-blocks 2c and 2c + 1's codes, the low and the high nibbles of the 32 bytes at qs + 32c;
// Q5_K's fifth bits come from qh, where bit j of byte l belongs to code l of sub-block j.
template <int64_t F>
inline void k_codes(const uint8_t* qs, __m256i qh, int c, __m256i& lo, __m256i& up) {
  const __m256i low4 = _mm256_set1_epi8(0xF), x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
  lo = _mm256_and_si256(x, low4), up = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4);
  if constexpr (F == Q5_K) {
    const __m256i five = _mm256_set1_epi8(0x10);
    const int j0 = 2 * c, j1 = 2 * c + 1;
    lo = _mm256_or_si256(lo, _mm256_and_si256(j0 <= 4 ? _mm256_slli_epi16(qh, 4 - j0) : _mm256_srli_epi16(qh, j0 - 4), five));
    up = _mm256_or_si256(up, _mm256_and_si256(j1 <= 4 ? _mm256_slli_epi16(qh, 4 - j1) : _mm256_srli_epi16(qh, j1 - 4), five));
  }
}

template <int64_t F>
inline void decode(const uint8_t* row, int64_t g, int64_t nblocks, Group& out) {
  if constexpr (F == Q8_0 || F == Q4_0 || F == Q5_0) {
    const int64_t first = g * 8;
    out.count = static_cast<int>(std::min<int64_t>(8, nblocks - first));
    for (int j = 0; j < 8; ++j) {
      if (j >= out.count) {
        out.scale[j] = 0.f;
        continue;
      }
      const uint8_t* b = row + (first + j) * block_bytes(F);
      out.scale[j] = half(b);
      if constexpr (F == Q8_0) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
        put(out.w[j], w);
        put(out.u[j], _mm256_abs_epi8(w));
      } else if constexpr (F == Q4_0) {
        put(out.u[j], nibbles16(b + 2));
      } else {
        put(out.u[j], q5_codes(b));
      }
    }
  } else if constexpr (F == Q6_K) {
    out.count = 8;
    const uint8_t* b = row + g * block_bytes(F);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    const __m256i bias = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      __m256i codes[4];
      q6k_codes(b, h, codes);
      for (int c = 0; c < 4; ++c) {
        const __m256i w = _mm256_sub_epi8(codes[c], bias);
        put(out.w[4 * h + c], w);
        put(out.u[4 * h + c], _mm256_abs_epi8(w));
      }
    }
    for (int j = 0; j < 8; ++j) {
      out.scale[j] = d;
      put(out.lane_scale[j], _mm256_set_m128i(_mm_set1_epi32(sc[2 * j + 1]), _mm_set1_epi32(sc[2 * j])));
    }
  } else {  // Q4_K, Q5_K
    out.count = 8;
    const uint8_t* b = row + g * block_bytes(F);
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* qs = b + (F == Q5_K ? 48 : 16);
    __m256i scs, mins;
    k_scales_mins(b + 4, scs, mins);
    _mm256_store_ps(out.scale, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(scs)));
    _mm256_store_ps(out.min, _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(mins)));
    [[maybe_unused]] const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    for (int c = 0; c < 4; ++c) {
      __m256i lo, up;
      k_codes<F>(qs, qh, c, lo, up);
      put(out.u[2 * c], lo);
      put(out.u[2 * c + 1], up);
    }
  }
}

// A group's eight block dots (lane j: block j's) into a row's eight lanes: the float steps every path
// takes, so a row among few (few_dots, block_few.cpp) and inside a chunk (accumulate) gets the same bits.
template <int64_t F>
inline __m256 settle(__m256i dots, __m256 scale, __m256 min, const float* xs, const int32_t* xsum,
                     const float* xscaled, __m256 acc) {
  constexpr Traits t = traits(F);
  if constexpr (t.offset != 0) {  // 8 or 16: a shift
    const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xsum));
    dots = _mm256_sub_epi32(dots, _mm256_slli_epi32(sums, t.offset == 8 ? 3 : 4));
  }
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scale, _mm256_loadu_ps(xs)), acc);
  if constexpr (t.has_min) acc = _mm256_fnmadd_ps(min, _mm256_loadu_ps(xscaled), acc);
  return acc;
}

// acc (8 lanes) += this group's blocks for one row of codes.
template <int64_t F>
inline void accumulate(const Group& g, const int8_t* q, const float* xs, const int32_t* xsum,
                       const float* xscaled, float* acc) {
  constexpr Traits t = traits(F);
  __m256i p[8];
  for (int j = 0; j < 8; ++j) {
    if (j >= g.count) {
      p[j] = _mm256_setzero_si256();
      continue;
    }
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * QB));
    const __m256i u = _mm256_load_si256(reinterpret_cast<const __m256i*>(g.u[j]));
    const __m256i s = t.is_signed ? _mm256_sign_epi8(codes, _mm256_load_si256(reinterpret_cast<const __m256i*>(g.w[j]))) : codes;
    p[j] = dot_u8s8(u, s);
    if (t.lane_scaled) p[j] = _mm256_mullo_epi32(p[j], _mm256_load_si256(reinterpret_cast<const __m256i*>(g.lane_scale[j])));
  }
  const __m256 a = settle<F>(sum_each(p), _mm256_load_ps(g.scale), _mm256_load_ps(g.min), xs, xsum, xscaled, _mm256_loadu_ps(acc));
  _mm256_storeu_ps(acc, a);
}

inline uint16_t half_bits(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

#else
// The same integers and the same float operations, one lane at a time.
template <int64_t F>
inline void decode(const uint8_t* row, int64_t g, int64_t nblocks, Group& out) { decode_plain(F, row, g, nblocks, out); }

template <int64_t F>
inline void accumulate(const Group& g, const int8_t* q, const float* xs, const int32_t* xsum,
                       const float* xscaled, float* acc) {
  constexpr Traits t = traits(F);
  for (int j = 0; j < 8; ++j) {
    int32_t dot = 0;
    if (j < g.count)
      for (int lane = 0; lane < 8; ++lane) {
        int32_t part = 0;
        for (int i = 4 * lane; i < 4 * lane + 4; ++i)
          part += (t.is_signed ? static_cast<int32_t>(g.w[j][i]) : static_cast<int32_t>(g.u[j][i])) * q[i + j * QB];
        dot += t.lane_scaled ? part * g.lane_scale[j][lane] : part;
      }
    if (t.offset) dot -= xsum[j] * t.offset;
    acc[j] = std::fma(static_cast<float>(dot), g.scale[j] * xs[j], acc[j]);
    if (t.has_min) acc[j] = std::fma(-g.min[j], xscaled[j], acc[j]);
  }
}
#endif

}  // namespace block_kernels
