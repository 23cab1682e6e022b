// y = x @ W^T for weights kept in GGUF's block formats (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K), as stored.
//
// The weight arrives as one uint8 tensor (engine/kernels/block_weight.py): a 256-byte header of int64
// [MAGIC, K, parts, then (format, rows, byte offset) per part], then each part's rows as the file holds
// them, every row its K / block-size blocks in order. A fused matrix (q|k|v, gate|up) is its parts one
// after another, each in its own format, the outputs side by side.
//
// Each row of x is quantized on its own to int8 in blocks of 32 (scale = max |x| / 127, round to nearest
// even): a row's codes never depend on another row. Per output, every 32-block of a row gives an exact
// integer dot product of the weight's codes and the row's codes (vpdpbusd where the CPU has AVX-512 VNNI
// or AVX-VNNI, AVX2's vpmaddubsw + vpmaddwd otherwise, plain C++ in the fallback: the same integers).
// Blocks go eight at a time into eight float lanes: lane j += dot_j * (weight scale_j * row scale_j) by
// one fused multiply-add, minus weight min_j * row sum_j (Q4_K, Q5_K) by another; the eight lanes are
// added in one fixed tree at the end. Every output of every row runs this one chain, fixed by K alone,
// whatever the number of rows, their order or the thread count (threads split the outputs), so a row
// alone and inside any batch gives the same bits; the plain build computes the same floats with fmaf.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace block_kernels {

constexpr int64_t MAGIC = 0x4b45564230303031;  // "KEVB0001"
constexpr int64_t HEADER_BYTES = 256, MAX_PARTS = 9;
constexpr int QB = 32;            // a block of the row's codes
constexpr int GROUP = 8 * QB;     // eight blocks: one lane each
constexpr int64_t TILE = 16;      // outputs per task
constexpr int64_t ROW_CHUNK = 128;  // rows whose accumulators live together while a weight group is decoded
constexpr int64_t PAIR_MIN_ROWS = 6;  // fewer rows than this: decoding four outputs' groups costs more than pairs save

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
  int8_t* qi = nullptr;      // many rows, VNNI: each group's codes interleaved (see interleave_codes)
  int32_t* halves = nullptr;  // many rows, VNNI: per block, the sums of its two 16-code halves (Q6_K)
};

// A group of eight 32-byte blocks as eight registers of 4-byte pieces: register c holds bytes 4c..4c+3 of
// block j in lane j, so one vpdpbusd per register adds a piece of every block into that block's own lane,
// and a group's eight block dots come out lane by lane without a horizontal sum. Only where the bytes go
// changes: every block dot is the same integer.
inline void interleave(const uint8_t* blocks, uint8_t* out) {
  for (int c = 0; c < 8; ++c)
    for (int j = 0; j < 8; ++j) std::memcpy(out + c * 32 + j * 4, blocks + j * QB + c * 4, 4);
}

template <typename X>
void quantize_row(const X* x, int64_t k, int8_t* q, float* scale, int32_t* sum, float* scaled_sum, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b) {
    if (b * QB >= k) {
      std::memset(q + b * QB, 0, QB);
      scale[b] = 0.f, sum[b] = 0, scaled_sum[b] = 0.f;
      continue;
    }
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

template <int64_t F>
inline void decode(const uint8_t* row, int64_t g, int64_t nblocks, Group& out) {
  const __m256i low4 = _mm256_set1_epi8(0xF);
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
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      k_scale_min(b + 4, j, sc, m);
      out.scale[j] = d * static_cast<float>(sc);
      out.min[j] = dmin * static_cast<float>(m);
    }
    [[maybe_unused]] const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    for (int c = 0; c < 4; ++c) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      __m256i lo = _mm256_and_si256(x, low4), up = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4);
      if constexpr (F == Q5_K) {  // bit j of qh's byte l is code l's fifth bit in sub-block j
        const __m256i five = _mm256_set1_epi8(0x10);
        const int j0 = 2 * c, j1 = 2 * c + 1;
        const __m256i b0 = j0 <= 4 ? _mm256_slli_epi16(qh, 4 - j0) : _mm256_srli_epi16(qh, j0 - 4);
        const __m256i b1 = j1 <= 4 ? _mm256_slli_epi16(qh, 4 - j1) : _mm256_srli_epi16(qh, j1 - 4);
        lo = _mm256_or_si256(lo, _mm256_and_si256(b0, five));
        up = _mm256_or_si256(up, _mm256_and_si256(b1, five));
      }
      put(out.u[2 * c], lo);
      put(out.u[2 * c + 1], up);
    }
  }
}

// A group's eight block dots (lane j: block j's) into a row's eight lanes: the float steps every path
// takes, so a row computed alone (row_dot) and inside a chunk (accumulate) gets the same bits.
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

inline __m256i signed_dot(__m256i w, const int8_t* q) {
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return dot_u8s8(_mm256_abs_epi8(w), _mm256_sign_epi8(codes, w));
}

inline __m256i unsigned_dot(__m256i u, const int8_t* q) {
  return dot_u8s8(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
}

inline uint16_t half_bits(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

// One output of one row: every group decoded straight into registers (a decode step's single row
// would spend more on storing and reloading a Group than on its dot products). The same integers and
// float steps as accumulate's.
template <int64_t F>
inline float row_dot(const uint8_t* row, int64_t groups, int64_t nblocks, const Codes& c, int64_t r) {
  const __m256i low4 = _mm256_set1_epi8(0xF);
  __m256 acc = _mm256_setzero_ps();
  const int8_t* q = c.q + r * c.stride;
  const int64_t b0 = r * c.blocks;
  for (int64_t gi = 0; gi < groups; ++gi, q += GROUP) {
    __m256i p[8];
    __m256 scale, min = _mm256_setzero_ps();
    if constexpr (F == Q8_0 || F == Q4_0 || F == Q5_0) {
      const int64_t first = gi * 8;
      const int count = static_cast<int>(std::min<int64_t>(8, nblocks - first));
      alignas(16) uint16_t halves[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int j = 0; j < 8; ++j) {
        if (j >= count) {
          p[j] = _mm256_setzero_si256();
          continue;
        }
        const uint8_t* b = row + (first + j) * block_bytes(F);
        halves[j] = half_bits(b);
        if constexpr (F == Q8_0) {
          p[j] = signed_dot(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), q + j * QB);
        } else if constexpr (F == Q4_0) {
          p[j] = unsigned_dot(nibbles16(b + 2), q + j * QB);
        } else {
          p[j] = unsigned_dot(q5_codes(b), q + j * QB);
        }
      }
      scale = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(halves)));
    } else if constexpr (F == Q6_K) {
      const uint8_t* b = row + gi * block_bytes(F);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      scale = _mm256_set1_ps(half(b + 208));
      const __m256i bias = _mm256_set1_epi8(32);
      for (int h = 0; h < 2; ++h) {
        __m256i codes[4];
        q6k_codes(b, h, codes);
        for (int k = 0; k < 4; ++k) {
          const int j = 4 * h + k;
          const __m256i lanes = _mm256_set_m128i(_mm_set1_epi32(sc[2 * j + 1]), _mm_set1_epi32(sc[2 * j]));
          p[j] = _mm256_mullo_epi32(signed_dot(_mm256_sub_epi8(codes[k], bias), q + j * QB), lanes);
        }
      }
    } else {  // Q4_K, Q5_K
      const uint8_t* b = row + gi * block_bytes(F);
      alignas(32) int32_t scs[8], mins[8];
      for (int j = 0; j < 8; ++j) k_scale_min(b + 4, j, scs[j], mins[j]);
      scale = _mm256_mul_ps(_mm256_set1_ps(half(b)), _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(scs))));
      min = _mm256_mul_ps(_mm256_set1_ps(half(b + 2)), _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mins))));
      const uint8_t* qs = b + (F == Q5_K ? 48 : 16);
      [[maybe_unused]] const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      for (int k = 0; k < 4; ++k) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * k));
        __m256i lo = _mm256_and_si256(x, low4), up = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4);
        if constexpr (F == Q5_K) {
          const __m256i five = _mm256_set1_epi8(0x10);
          const int j0 = 2 * k, j1 = 2 * k + 1;
          lo = _mm256_or_si256(lo, _mm256_and_si256(j0 <= 4 ? _mm256_slli_epi16(qh, 4 - j0) : _mm256_srli_epi16(qh, j0 - 4), five));
          up = _mm256_or_si256(up, _mm256_and_si256(j1 <= 4 ? _mm256_slli_epi16(qh, 4 - j1) : _mm256_srli_epi16(qh, j1 - 4), five));
        }
        p[2 * k] = unsigned_dot(lo, q + 2 * k * QB);
        p[2 * k + 1] = unsigned_dot(up, q + (2 * k + 1) * QB);
      }
    }
    const int64_t b = b0 + gi * 8;
    acc = settle<F>(sum_each(p), scale, min, c.scale + b, c.sum + b, c.scaled_sum + b, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  return lanes_sum(lanes);
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
// Many rows on a CPU with VNNI: the weight group decoded once per chunk of rows and woven (see interleave),
// then per row eight vpdpbusd into one register whose lane j is block j's dot: the integers row_dot and
// accumulate make, settled by the same float steps, so a row's bits are those of the one-row path. Signed
// codes go in as unsigned ones (Q8_0: w + 128, Q6_K: w + 32), taken off exactly with the row's code sums;
// vpdpbusd adds u8 x s8 products in int32, so nothing saturates (AVX2's vpmaddubsw would: its path stays).
#define KEV_WOVEN 1
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}

struct Woven {
  alignas(32) uint8_t u[8 * QB];
  alignas(32) int32_t lo[8], hi[8];  // Q6_K: lane j's integer scale for block j's first and second 16 codes
};

// interleave's layout in registers: an 8x8 transpose of 4-byte pieces (block j's piece c to lane j of c).
inline void transpose_pieces(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]), u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]), u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c)
    r[c] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x20), r[c + 4] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x31);
}

template <int64_t F>
inline void weave(const Group& g, Woven& out) {
  __m256i u[8];
  for (int j = 0; j < 8; ++j) {
    u[j] = _mm256_setzero_si256();  // blocks past the row's end: zero codes, so a zero dot
    if (j < g.count) {
      if constexpr (F == Q8_0)
        u[j] = _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(g.w[j])), _mm256_set1_epi8(-128));
      else if constexpr (F == Q6_K)
        u[j] = _mm256_add_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(g.w[j])), _mm256_set1_epi8(32));
      else
        u[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(g.u[j]));
    }
  }
  transpose_pieces(u);
  for (int c = 0; c < 8; ++c) put(out.u + c * 32, u[c]);
  if constexpr (F == Q6_K)
    for (int j = 0; j < 8; ++j) out.lo[j] = g.lane_scale[j][0], out.hi[j] = g.lane_scale[j][4];
}

// The chunk's rows against one woven group: its eight pieces stay in registers across the rows.
template <int64_t F>
inline void woven_rows(const Woven& w, const Group& g, const Codes& c, int64_t r0, int64_t count, int64_t gi,
                       float* acc) {
  __m256i u[8];
  for (int piece = 0; piece < 8; ++piece) u[piece] = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.u + piece * 32));
  const __m256 scale = _mm256_load_ps(g.scale), min = _mm256_load_ps(g.min);
  for (int64_t r = 0; r < count; ++r) {
    const int64_t row = r0 + r, at = row * c.blocks + gi * 8;
    const int8_t* xi = c.qi + row * c.stride + gi * GROUP;
    __m256i first = _mm256_setzero_si256(), second = _mm256_setzero_si256();
    for (int piece = 0; piece < 8; ++piece) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + piece * 32));
      if (F == Q6_K && piece >= 4) second = dot_acc(second, u[piece], x);
      else first = dot_acc(first, u[piece], x);
    }
    if constexpr (F == Q8_0)
      first = _mm256_sub_epi32(first, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.sum + at)), 7));
    if constexpr (F == Q6_K) {
      const int32_t* h = c.halves + row * 2 * c.blocks + gi * 8;
      const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
      const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + c.blocks));
      first = _mm256_add_epi32(
          _mm256_mullo_epi32(_mm256_sub_epi32(first, _mm256_slli_epi32(h0, 5)), _mm256_load_si256(reinterpret_cast<const __m256i*>(w.lo))),
          _mm256_mullo_epi32(_mm256_sub_epi32(second, _mm256_slli_epi32(h1, 5)), _mm256_load_si256(reinterpret_cast<const __m256i*>(w.hi))));
    }
    _mm256_storeu_ps(acc + r * 8, settle<F>(first, scale, min, c.scale + at, c.sum + at, c.scaled_sum + at,
                                            _mm256_loadu_ps(acc + r * 8)));
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
// Two outputs side by side in one 512-bit register (lanes 0-7 the first's blocks, 8-15 the second's),
// P such pairs at a time: each row's codes are loaded once (broadcast to both halves) for 2P outputs.
// Every lane runs the 256-bit path's integer and float steps on the same values: the same bits.
#define KEV_PAIRS 1
inline __m512i both(const void* p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 both_ps(const float* p) { return _mm512_castsi512_ps(both(p)); }
inline __m512i halves_of(const void* a, const void* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

struct Pair {
  __m512i u[8];
  __m512i lo, hi;
  __m512 scale, min;
};

template <int64_t F>
inline void make_pair(const Woven& a, const Group& ga, const Woven& b, const Group& gb, Pair& p) {
  for (int piece = 0; piece < 8; ++piece) p.u[piece] = halves_of(a.u + piece * 32, b.u + piece * 32);
  p.scale = _mm512_castsi512_ps(halves_of(ga.scale, gb.scale));
  p.min = _mm512_castsi512_ps(halves_of(ga.min, gb.min));
  if constexpr (F == Q6_K) p.lo = halves_of(a.lo, b.lo), p.hi = halves_of(a.hi, b.hi);
}

template <int64_t F, int P>
inline void woven_pairs(const Pair* pairs, const Codes& c, int64_t r0, int64_t count, int64_t gi, float* const* acc) {
  constexpr Traits t = traits(F);
  for (int64_t r = 0; r < count; ++r) {
    const int64_t row = r0 + r, at = row * c.blocks + gi * 8;
    const int8_t* xi = c.qi + row * c.stride + gi * GROUP;
    __m512i first[P], second[P];
    for (int k = 0; k < P; ++k) first[k] = _mm512_setzero_si512(), second[k] = _mm512_setzero_si512();
    for (int piece = 0; piece < 8; ++piece) {
      const __m512i x = both(xi + piece * 32);
      for (int k = 0; k < P; ++k) {
        if (F == Q6_K && piece >= 4) second[k] = _mm512_dpbusd_epi32(second[k], pairs[k].u[piece], x);
        else first[k] = _mm512_dpbusd_epi32(first[k], pairs[k].u[piece], x);
      }
    }
    const __m512 xs = both_ps(c.scale + at);
    for (int k = 0; k < P; ++k) {
      __m512i dots = first[k];
      if constexpr (F == Q8_0) dots = _mm512_sub_epi32(dots, _mm512_slli_epi32(both(c.sum + at), 7));
      if constexpr (F == Q6_K) {
        const int32_t* h = c.halves + row * 2 * c.blocks + gi * 8;
        dots = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_sub_epi32(dots, _mm512_slli_epi32(both(h), 5)), pairs[k].lo),
                                _mm512_mullo_epi32(_mm512_sub_epi32(second[k], _mm512_slli_epi32(both(h + c.blocks), 5)), pairs[k].hi));
      }
      if constexpr (t.offset != 0) dots = _mm512_sub_epi32(dots, _mm512_slli_epi32(both(c.sum + at), t.offset == 8 ? 3 : 4));
      float* a = acc[k] + r * 16;
      __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(pairs[k].scale, xs), _mm512_loadu_ps(a));
      if constexpr (t.has_min) v = _mm512_fnmadd_ps(pairs[k].min, both_ps(c.scaled_sum + at), v);
      _mm512_storeu_ps(a, v);
    }
  }
}
#endif
#endif

inline const char* isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni";
#elif defined(__AVXVNNI__)
  return "avx-vnni";
#else
  return "avx2";
#endif
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

inline const char* isa() { return "plain"; }
#endif

struct Part {
  int64_t format, rows, offset, first_output;
};

struct Layout {
  int64_t k;
  std::vector<Part> parts;
};

inline Layout read_header(const torch::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::ScalarType::Byte && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() >= HEADER_BYTES, "block_linear: a packed uint8 weight");
  const auto* h = reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>());
  TORCH_CHECK(h[0] == MAGIC, "block_linear: not a Kev block weight");
  Layout layout{h[1], {}};
  TORCH_CHECK(h[2] > 0 && h[2] <= MAX_PARTS, "block_linear: ", h[2], " parts");
  int64_t first = 0;
  for (int64_t i = 0; i < h[2]; ++i) {
    const Part part{h[3 + 3 * i], h[4 + 3 * i], h[5 + 3 * i], first};
    TORCH_CHECK(layout.k % block_elems(part.format) == 0, "block_linear: K ", layout.k, " is no whole blocks");
    TORCH_CHECK(part.offset + part.rows * (layout.k / block_elems(part.format)) * block_bytes(part.format) <= packed.numel(),
                "block_linear: part ", i, " runs past the tensor");
    layout.parts.push_back(part);
    first += part.rows;
  }
  return layout;
}

#if defined(KEV_PAIRS)
// Outputs o .. o+3 of one group against the chunk's rows, as two pairs (see woven_pairs); each pair's
// accumulators, [row][16], take its two outputs' space in acc.
template <int64_t F>
inline void four_outputs(const Codes& c, const uint8_t* first_row, int64_t row_bytes, int64_t gi, int64_t nblocks,
                         int64_t r0, int64_t count, float* acc) {
  Pair pairs[2];
  Group g[2];
  Woven woven[2];
  float* acc_of[2];
  for (int k = 0; k < 2; ++k) {
    for (int j = 0; j < 2; ++j) {
      decode<F>(first_row + (2 * k + j) * row_bytes, gi, nblocks, g[j]);
      weave<F>(g[j], woven[j]);
    }
    make_pair<F>(woven[0], g[0], woven[1], g[1], pairs[k]);
    acc_of[k] = acc + 2 * k * count * 8;
  }
  woven_pairs<F, 2>(pairs, c, r0, count, gi, acc_of);
}

// A pair's two lanes_sum at once, in lanes 0 and 8: the same additions in the same order, lane by lane.
inline __m512 pair_sums(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));  // a0+a4 .. a3+a7
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));        // (a0+a4)+(a2+a6), (a1+a5)+(a3+a7)
  return _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
}

// The four outputs' values for the chunk's rows, from four_outputs' accumulators. Not inlined: inlined,
// it changed part_outputs' register allocation and cost Q6_K's rows 4-8% at 12-24 rows.
template <typename Y>
__attribute__((noinline)) void store_four(const float* acc, int64_t count, Y* y, int64_t n) {
  const __m512i pick = _mm512_setr_epi32(0, 8, 16, 24, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t r = 0; r < count; ++r) {
    const __m512 first = pair_sums(_mm512_loadu_ps(acc + r * 16)), second = pair_sums(_mm512_loadu_ps(acc + (count + r) * 16));
    alignas(16) float four[4];
    _mm_store_ps(four, _mm512_castps512_ps128(_mm512_permutex2var_ps(first, pick, second)));
    for (int j = 0; j < 4; ++j) y[r * n + j] = static_cast<Y>(four[j]);
  }
}
#endif

// Outputs [begin, end) of one part against every row, a chunk of rows at a time, group by group: each
// weight group is decoded once per chunk, and the chunk's codes for that group (count x 256 bytes) stay
// in L1 while the task's outputs use them. Every output keeps its own chains in acc: the order of a
// row's sums is fixed by K alone, whichever path (pairs, woven, accumulate) a chunk takes.
template <int64_t F, typename Y>
void part_outputs(const Codes& c, int64_t rows, const uint8_t* base, const Part& part, int64_t k, Y* y, int64_t n,
                  int64_t begin, int64_t end, Group& g, float* acc) {
  const int64_t nblocks = k / block_elems(F), row_bytes = nblocks * block_bytes(F), groups = c.blocks / 8;
  const uint8_t* rows_of_part = base + part.offset;
#if defined(__AVX2__) && defined(__FMA__)
  if (rows == 1) {
    for (int64_t o = begin; o < end; ++o)
      y[part.first_output + o] = static_cast<Y>(row_dot<F>(rows_of_part + o * row_bytes, groups, nblocks, c, 0));
    return;
  }
#endif
#if defined(KEV_WOVEN)
  Woven woven;
#endif
  for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
    const int64_t count = std::min(ROW_CHUNK, rows - r0);
    int64_t paired = 0;  // outputs begin .. begin+paired-1 take four_outputs
#if defined(KEV_PAIRS)
    if (c.qi != nullptr && count >= PAIR_MIN_ROWS) paired = (end - begin) / 4 * 4;
#endif
    std::fill(acc, acc + (end - begin) * count * 8, 0.f);  // acc: [output][row][8], pairs [row][16]
    for (int64_t gi = 0; gi < groups; ++gi) {
#if defined(KEV_PAIRS)
      for (int64_t o = begin; o < begin + paired; o += 4)
        four_outputs<F>(c, rows_of_part + o * row_bytes, row_bytes, gi, nblocks, r0, count, acc + (o - begin) * count * 8);
#endif
      for (int64_t o = begin + paired; o < end; ++o) {
        float* out = acc + (o - begin) * count * 8;
        decode<F>(rows_of_part + o * row_bytes, gi, nblocks, g);
#if defined(KEV_WOVEN)
        if (c.qi != nullptr) {
          weave<F>(g, woven);
          woven_rows<F>(woven, g, c, r0, count, gi, out);
          continue;
        }
#endif
        for (int64_t r = 0; r < count; ++r) {
          const int64_t row = r0 + r, b = row * c.blocks + gi * 8;
          accumulate<F>(g, c.q + row * c.stride + gi * GROUP, c.scale + b, c.sum + b, c.scaled_sum + b, out + r * 8);
        }
      }
    }
#if defined(KEV_PAIRS)
    for (int64_t o = begin; o < begin + paired; o += 4)
      store_four(acc + (o - begin) * count * 8, count, y + r0 * n + part.first_output + o, n);
#endif
    for (int64_t o = begin + paired; o < end; ++o)
      for (int64_t r = 0; r < count; ++r)
        y[(r0 + r) * n + part.first_output + o] = static_cast<Y>(lanes_sum(acc + ((o - begin) * count + r) * 8));
  }
}

template <typename Y>
void multiply_rows(const Codes& c, int64_t rows, const uint8_t* base, const Layout& layout, Y* y, int64_t n) {
  struct Task {
    const Part* part;
    int64_t begin, end;
  };
  std::vector<Task> tasks;
  for (const Part& part : layout.parts)
    for (int64_t r = 0; r < part.rows; r += TILE) tasks.push_back({&part, r, std::min(part.rows, r + TILE)});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    Group g;
    std::vector<float> acc(TILE * ROW_CHUNK * 8);
    for (int64_t t = t0; t < t1; ++t) {
      const Part& p = *tasks[t].part;
      auto run = [&](auto format) {
        part_outputs<decltype(format)::value>(c, rows, base, p, layout.k, y, n, tasks[t].begin, tasks[t].end, g, acc.data());
      };
      switch (p.format) {
        case Q4_0: run(std::integral_constant<int64_t, Q4_0>{}); break;
        case Q5_0: run(std::integral_constant<int64_t, Q5_0>{}); break;
        case Q8_0: run(std::integral_constant<int64_t, Q8_0>{}); break;
        case Q4_K: run(std::integral_constant<int64_t, Q4_K>{}); break;
        case Q5_K: run(std::integral_constant<int64_t, Q5_K>{}); break;
        default: run(std::integral_constant<int64_t, Q6_K>{}); break;
      }
    }
  });
}

// Without the GIL (the caller released it). x: [M, K] fp32 or bf16; y takes x's dtype.
torch::Tensor multiply(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  const Layout layout = read_header(packed);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == layout.k, "block_linear: x [M, ", layout.k, "] contiguous");
  TORCH_CHECK(layout.parts.back().first_output + layout.parts.back().rows == n, "block_linear: ", n, " outputs asked");
  const int64_t rows = x.size(0), k = layout.k;
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0) return y;
  const int64_t blocks = (k + GROUP - 1) / GROUP * 8;
  std::vector<int8_t> q(rows * blocks * QB);
  std::vector<float> scale(rows * blocks), scaled(rows * blocks);
  std::vector<int32_t> sum(rows * blocks);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* codes = q.data() + r * blocks * QB;
      float *s = scale.data() + r * blocks, *ss = scaled.data() + r * blocks;
      int32_t* total = sum.data() + r * blocks;
      if (x.scalar_type() == at::ScalarType::Float)
        quantize_row(x.data_ptr<float>() + r * k, k, codes, s, total, ss, blocks);
      else
        quantize_row(x.data_ptr<at::BFloat16>() + r * k, k, codes, s, total, ss, blocks);
    }
  });
  Codes c{q.data(), scale.data(), sum.data(), scaled.data(), blocks * QB, blocks};
#if defined(KEV_WOVEN)
  std::vector<int8_t> woven_codes;
  std::vector<int32_t> halves;
  if (rows > 1) {  // one row takes row_dot, which reads the codes as they are
    woven_codes.resize(q.size());
    halves.resize(rows * 2 * blocks);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int8_t* codes = q.data() + r * blocks * QB;
        for (int64_t gi = 0; gi < blocks / 8; ++gi)
          interleave(reinterpret_cast<const uint8_t*>(codes + gi * GROUP),
                     reinterpret_cast<uint8_t*>(woven_codes.data() + r * blocks * QB + gi * GROUP));
        for (int64_t b = 0; b < blocks; ++b) {
          int32_t first = 0, second = 0;
          for (int i = 0; i < QB / 2; ++i) first += codes[b * QB + i], second += codes[b * QB + QB / 2 + i];
          halves[r * 2 * blocks + b] = first, halves[r * 2 * blocks + blocks + b] = second;
        }
      }
    });
    c.qi = woven_codes.data(), c.halves = halves.data();
  }
#endif
  const auto* base = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == at::ScalarType::Float)
    multiply_rows(c, rows, base, layout, y.data_ptr<float>(), n);
  else {
    TORCH_CHECK(x.scalar_type() == at::ScalarType::BFloat16, "block_linear: fp32 or bf16 rows");
    multiply_rows(c, rows, base, layout, y.data_ptr<at::BFloat16>(), n);
  }
  return y;
}

// The weight's values for output rows `ids`, as float: each code times its scale (minus its min), the
// roundings ggml's dequantisation makes.
torch::Tensor rows(const torch::Tensor& packed, const torch::Tensor& ids) {
  const Layout layout = read_header(packed);
  const int64_t k = layout.k;
  auto out = torch::empty({ids.numel(), k}, torch::kFloat32);
  const auto id = ids.to(torch::kInt64).contiguous();
  const auto* base = packed.data_ptr<uint8_t>();
  const int64_t total = layout.parts.back().first_output + layout.parts.back().rows;
  if (ids.numel() > 0)
    TORCH_CHECK(id.min().item<int64_t>() >= 0 && id.max().item<int64_t>() < total, "block_linear: a row outside 0 .. ", total - 1);
  at::parallel_for(0, ids.numel(), 8, [&](int64_t begin, int64_t end) {
    Group g;
    for (int64_t i = begin; i < end; ++i) {
      int64_t o = id.data_ptr<int64_t>()[i];
      const Part* part = &layout.parts[0];
      for (const Part& p : layout.parts)
        if (o >= p.first_output) part = &p;
      o -= part->first_output;
      const Traits tr = traits(part->format);
      const int64_t per_block = block_elems(part->format), nblocks = k / per_block;
      const uint8_t* wrow = base + part->offset + o * nblocks * block_bytes(part->format);
      float* y = out.data_ptr<float>() + i * k;
      for (int64_t gi = 0; gi * GROUP < k; ++gi) {
        decode_plain(part->format, wrow, gi, nblocks, g);
        for (int j = 0; j < g.count; ++j)
          for (int l = 0; l < QB; ++l) {
            const int code = tr.is_signed ? g.w[j][l] : g.u[j][l] - tr.offset;
            const float scale = tr.lane_scaled ? g.scale[j] * static_cast<float>(g.lane_scale[j][l / 4]) : g.scale[j];
            y[gi * GROUP + j * QB + l] = scale * static_cast<float>(code) - g.min[j];
          }
      }
    }
  });
  return out;
}

}  // namespace block_kernels

torch::Tensor block_linear(torch::Tensor x, torch::Tensor packed, int64_t n) {
  pybind11::gil_scoped_release no_gil;
  return block_kernels::multiply(x, packed, n);
}

torch::Tensor block_rows(torch::Tensor packed, torch::Tensor ids) {
  pybind11::gil_scoped_release no_gil;
  return block_kernels::rows(packed, ids);
}

// The int8 dot product this build uses: avx512-vnni, avx-vnni, avx2 or plain.
std::string block_linear_isa() { return block_kernels::isa(); }
