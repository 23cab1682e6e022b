// block_linear.cpp's many-row paths with AVX2: each weight group woven so one dot product (vpdpbusd with
// VNNI) adds into eight blocks' lanes, and with AVX-512 four outputs at a time as two 512-bit pairs. Compiled after
// block_formats.cpp and block_few.cpp, in one translation unit (native.py).

namespace block_kernels {

struct Prepared;  // below, with AVX2; the plain build passes none

#if defined(__AVX2__) && defined(__FMA__)
// Many rows: the weight group decoded once per chunk of rows and woven (transpose_pieces), then per row eight
// dot products into one register whose lane j is block j's dot: the integers few_dots and accumulate make,
// settled by the same float steps, so a row's bits are those of the few-row path. Signed codes go in as
// unsigned ones (Q8_0: w + 128, Q6_K: w + 32), taken off exactly with the row's code sums. VNNI's vpdpbusd
// adds u8 x s8 products in int32; without it, vpmaddubsw's int16 pair sums would saturate on Q8_0's
// offset codes (255 x 127 x 2), so there Q8_0 is woven as |w| beside w, and each row's codes take w's
// signs (accumulate's integers: |w| x sign(x, w), a pair at most 2 x 128 x 127).
#define KEV_WOVEN 1
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define KEV_VNNI 1
constexpr bool SIGNED_WEAVE = false;
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#else
constexpr bool SIGNED_WEAVE = true;  // Q8_0 woven as |w| and w
// Two pieces' vpmaddubsw pair sums added in int16, then widened once by vpmaddwd: every code woven here
// is at most 63 (Q6_K's w + 32) and every row code at most 127 in size, so the int16 sum of two pairs
// stays within 4 x 63 x 127 = 32,004 < 2^15 and the int32 dot is exact, as vpdpbusd's.
inline __m256i dot_acc2(__m256i acc, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// How many pieces' pair sums add in int16 before one vpmaddwd. Each pair is at most 2 x code x 127: Q5_0's
// codes (at most 31) leave room for four (31,496), the same exact integers with half the widenings: 1.03-1.05x
// on Qwen2.5-0.5B's Q5_0 matrices at 8-256 rows (AVX2-only AMD EPYC). Q4_K's (15) would take eight, but ran
// 0.98-1.00x; Q4_0 and Q5_K are unmeasured. The rest keep two, as Q6_K (63) must.
constexpr int int16_pieces(int64_t f) { return f == Q5_0 ? 4 : 2; }

// acc + the dot of `count` pieces (u[0..count), the row's codes from xi), their pair sums added in int16.
template <int N>
inline __m256i dot_acc_n(__m256i acc, const __m256i* u, const int8_t* xi) {
  __m256i pairs = _mm256_maddubs_epi16(u[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi)));
  for (int i = 1; i < N; ++i)
    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + i * 32))));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

struct Woven {
  alignas(32) uint8_t u[8 * QB];
  alignas(32) int8_t w[8 * QB];  // Q8_0 without VNNI: the signed codes, woven as u
  alignas(32) int32_t lo[8], hi[8];  // Q6_K: lane j's integer scale for block j's first and second 16 codes
};

// A group of eight 32-byte blocks as eight registers of 4-byte pieces: register c holds bytes 4c..4c+3 of
// block j in lane j, so one vpdpbusd per register adds a piece of every block into that block's own lane,
// and a group's eight block dots come out lane by lane without a horizontal sum. Only where the bytes go
// changes: every block dot is the same integer. An 8x8 transpose of 4-byte pieces, in registers.
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

// A row's codes for one group (eight blocks) laid out as transpose_pieces lays out a weight group.
inline void weave_codes(const int8_t* group, int8_t* out) {
  __m256i r[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + j * QB));
  transpose_pieces(r);
  for (int c = 0; c < 8; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c * 32), r[c]);
}

// Row r's record for group gi (RowGroup): its codes woven, its blocks' scales and sums copied beside them,
// and the half sums where a Q6_K part will read them.
inline void fill_row_group(const Codes& c, int64_t r, int64_t gi, bool halves, RowGroup& out) {
  const int8_t* codes = c.q + r * c.stride + gi * GROUP;
  weave_codes(codes, out.codes);
  const int64_t at = r * c.blocks + gi * 8;
  std::copy(c.scale + at, c.scale + at + 8, out.scale);
  std::copy(c.sum + at, c.sum + at + 8, out.sum);
  std::copy(c.scaled_sum + at, c.scaled_sum + at + 8, out.scaled_sum);
  for (int j = 0; halves && j < 8; ++j) {  // Q6_K's: its integer scales cover 16 codes each
    int32_t first = 0, second = 0;
    for (int i = 0; i < QB / 2; ++i) first += codes[j * QB + i], second += codes[j * QB + QB / 2 + i];
    out.halves[0][j] = first, out.halves[1][j] = second;
  }
}

template <int64_t F>
inline void weave(const Group& g, Woven& out) {
  __m256i u[8];
  for (int j = 0; j < 8; ++j) {
    u[j] = _mm256_setzero_si256();  // blocks past the row's end: zero codes, so a zero dot
    if (j < g.count) {
      if constexpr (F == Q8_0 && SIGNED_WEAVE)
        u[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(g.w[j]));
      else if constexpr (F == Q8_0)
        u[j] = _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(g.w[j])), _mm256_set1_epi8(-128));
      else if constexpr (F == Q6_K)
        u[j] = _mm256_add_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(g.w[j])), _mm256_set1_epi8(32));
      else
        u[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(g.u[j]));
    }
  }
  transpose_pieces(u);
  for (int c = 0; c < 8; ++c) {
    if constexpr (F == Q8_0 && SIGNED_WEAVE) put(out.w + c * 32, u[c]), u[c] = _mm256_abs_epi8(u[c]);
    put(out.u + c * 32, u[c]);
  }
  if constexpr (F == Q6_K)
    for (int j = 0; j < 8; ++j) out.lo[j] = g.lane_scale[j][0], out.hi[j] = g.lane_scale[j][4];
}

// A weight group as the chunks after the first find it (part_outputs): woven, with its block scales and mins.
struct Prepared {
  Woven woven;
  alignas(32) float scale[8], min[8];
};

// The chunk's rows against one woven group: its eight pieces stay in registers across the rows.
template <int64_t F, bool fresh>
inline void woven_chains(const Woven& w, const float* scales, const float* mins, const Codes& c, int64_t r0, int64_t count,
                         int64_t gi, float* acc) {
  __m256i u[8];
  for (int piece = 0; piece < 8; ++piece) u[piece] = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.u + piece * 32));
  const __m256 scale = _mm256_load_ps(scales), min = _mm256_load_ps(mins);
  // the rows' fields walked by pointer, kept in registers: acc's float stores may alias c's, so each row
  // would otherwise reload them and multiply its offsets again
  const RowGroup* x = c.woven + gi * c.rows + r0;
  for (int64_t r = 0; r < count; ++r, ++x) {
    const int8_t* xi = x->codes;
    __m256i first = _mm256_setzero_si256(), second = _mm256_setzero_si256();
#if defined(KEV_VNNI)
    for (int piece = 0; piece < 8; ++piece) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + piece * 32));
      if (F == Q6_K && piece >= 4) second = dot_acc(second, u[piece], x);
      else first = dot_acc(first, u[piece], x);
    }
#else
    if constexpr (F == Q8_0) {  // vpmaddubsw's pairs of |w| x sign(x, w) fit int16; two pieces' sums would not
      for (int piece = 0; piece < 8; ++piece) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + piece * 32));
        const __m256i s = _mm256_sign_epi8(x, _mm256_load_si256(reinterpret_cast<const __m256i*>(w.w + piece * 32)));
        first = _mm256_add_epi32(first, dot_u8s8(u[piece], s));
      }
    } else if constexpr (F == Q6_K) {
      for (int piece = 0; piece < 8; piece += 2) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + piece * 32));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + piece * 32 + 32));
        if (piece >= 4) second = dot_acc2(second, u[piece], x0, u[piece + 1], x1);
        else first = dot_acc2(first, u[piece], x0, u[piece + 1], x1);
      }
    } else {
      constexpr int N = int16_pieces(F);
      for (int piece = 0; piece < 8; piece += N) first = dot_acc_n<N>(first, u + piece, xi + piece * 32);
    }
#endif
    if constexpr (F == Q8_0 && !SIGNED_WEAVE)
      first = _mm256_sub_epi32(first, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->sum)), 7));
    if constexpr (F == Q6_K) {
      const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->halves[0]));
      const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->halves[1]));
      first = _mm256_add_epi32(
          _mm256_mullo_epi32(_mm256_sub_epi32(first, _mm256_slli_epi32(h0, 5)), _mm256_load_si256(reinterpret_cast<const __m256i*>(w.lo))),
          _mm256_mullo_epi32(_mm256_sub_epi32(second, _mm256_slli_epi32(h1, 5)), _mm256_load_si256(reinterpret_cast<const __m256i*>(w.hi))));
    }
    const __m256 before = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * 8);
    _mm256_storeu_ps(acc + r * 8, settle<F>(first, scale, min, x->scale, x->sum, x->scaled_sum, before));
  }
}

// The first group's chains start from +0 (what a zeroed acc holds) without reading acc, which is not zeroed.
template <int64_t F>
inline void woven_rows(const Woven& w, const float* scales, const float* mins, const Codes& c, int64_t r0, int64_t count,
                       int64_t gi, float* acc) {
  if (gi == 0) woven_chains<F, true>(w, scales, mins, c, r0, count, gi, acc);
  else woven_chains<F, false>(w, scales, mins, c, r0, count, gi, acc);
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

// R rows of the chunk against P pairs, R x P chains side by side. acc[k] + row * 32: the pairs' sums
// interleave row by row (four_outputs).
template <int64_t F, int P, int R>
inline void pair_rows(const Pair* pairs, const Codes& c, int64_t r0, int64_t r, int64_t gi, float* const* acc) {
  constexpr Traits t = traits(F);
  __m512i first[R][P], second[R][P];
  const RowGroup* x[R];
  for (int i = 0; i < R; ++i) {
    x[i] = c.woven + gi * c.rows + r0 + r + i;
    for (int k = 0; k < P; ++k) first[i][k] = _mm512_setzero_si512(), second[i][k] = _mm512_setzero_si512();
  }
  for (int piece = 0; piece < 8; ++piece)
    for (int i = 0; i < R; ++i) {
      const __m512i codes = both(x[i]->codes + piece * 32);
      for (int k = 0; k < P; ++k) {
        if (F == Q6_K && piece >= 4) second[i][k] = _mm512_dpbusd_epi32(second[i][k], pairs[k].u[piece], codes);
        else first[i][k] = _mm512_dpbusd_epi32(first[i][k], pairs[k].u[piece], codes);
      }
    }
  for (int i = 0; i < R; ++i) {
    // loaded once for the P pairs: the compiler may not hoist them past the stores into acc
    const __m512 xs = both_ps(x[i]->scale);
    __m512i sums;
    if constexpr (F == Q8_0 || t.offset != 0) sums = both(x[i]->sum);
    __m512 scaled_sums;
    if constexpr (t.has_min) scaled_sums = both_ps(x[i]->scaled_sum);
    for (int k = 0; k < P; ++k) {
      __m512i dots = first[i][k];
      if constexpr (F == Q8_0) dots = _mm512_sub_epi32(dots, _mm512_slli_epi32(sums, 7));
      if constexpr (F == Q6_K) {
        dots = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_sub_epi32(dots, _mm512_slli_epi32(both(x[i]->halves[0]), 5)), pairs[k].lo),
                                _mm512_mullo_epi32(_mm512_sub_epi32(second[i][k], _mm512_slli_epi32(both(x[i]->halves[1]), 5)), pairs[k].hi));
      }
      if constexpr (t.offset != 0) dots = _mm512_sub_epi32(dots, _mm512_slli_epi32(sums, t.offset == 8 ? 3 : 4));
      float* a = acc[k] + (r + i) * 32;
      __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(pairs[k].scale, xs), _mm512_loadu_ps(a));
      if constexpr (t.has_min) v = _mm512_fnmadd_ps(pairs[k].min, scaled_sums, v);
      _mm512_storeu_ps(a, v);
    }
  }
}

// Two rows at a time (1.03-1.08x on Q5_0 and Q8_0 at 128+ rows) but for Q6_K, whose second chains and
// integer scales do not fit the registers with two rows.
template <int64_t F, int P>
inline void woven_pairs(const Pair* pairs, const Codes& c, int64_t r0, int64_t count, int64_t gi, float* const* acc) {
  constexpr int R = F == Q6_K ? 1 : 2;
  int64_t r = 0;
  for (; r + R <= count; r += R) pair_rows<F, P, R>(pairs, c, r0, r, gi, acc);
  for (; r < count; ++r) pair_rows<F, P, 1>(pairs, c, r0, r, gi, acc);
}
#endif

#if defined(KEV_PAIRS)
// Outputs o .. o+3 of one group against the chunk's rows, as two pairs (see woven_pairs). The quad's
// accumulators are [row][pair][16]: with each pair's rows in a run of their own the two runs sat 8 KiB
// apart at 128-row chunks, one pair's loads and the other's stores a multiple of 4 KiB apart, and the
// same loop ran 1.03-1.16x slower.
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
    acc_of[k] = acc + k * 16;
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
    const __m512 first = pair_sums(_mm512_loadu_ps(acc + r * 32)), second = pair_sums(_mm512_loadu_ps(acc + r * 32 + 16));
    alignas(16) float four[4];
    _mm_store_ps(four, _mm512_castps512_ps128(_mm512_permutex2var_ps(first, pick, second)));
    for (int j = 0; j < 4; ++j) y[r * n + j] = static_cast<Y>(four[j]);
  }
}
#endif
#endif  // AVX2

}  // namespace block_kernels
