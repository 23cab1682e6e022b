// block_linear.cpp's path for a decode step's few rows: each output's weight row decoded once, group by
// group, straight into registers, and dotted with every row's codes. Storing and reloading a Group, as
// the many-row paths do, costs more than the dot products it would save at this many rows. Compiled after
// block_formats.cpp, in one translation unit (native.py).

namespace block_kernels {

// Most rows of a matrix in format f, of `bytes` bytes, that take few_dots: where the woven paths start to
// win, measured per format on an AVX2-only AMD EPYC (Qwen2.5-0.5B's matrices and SmolLM2-shaped Q8_0 ones,
// 1-24 rows). Without VNNI, Q8_0 weaves |w| beside w, which costs more than four rows' dot products: on a
// matrix larger than the caches (Qwen's 145 MB head) few_dots won to 12 rows (1.2-1.9x at 4-12), on one
// that fits them (SmolLM2's, 0.2-1.8 MB) to 4. With VNNI (an Intel Xeon, Sapphire Rapids; matrices streamed
// from memory, as a decode step reads them), few_dots won at 3-4 rows in each format measured (Q8_0, Q4_K,
// Q5_0, Q6_K: 1.17-1.44x over weaving), and Q8_0's to 6 (0.99-1.21x; 0.86-1.12x at 8). Every path gives a
// row the same bits, so the choice is speed alone.
constexpr int64_t LARGE_BYTES = int64_t(32) << 20;

constexpr int64_t few_rows(int64_t f, int64_t bytes) {
#if !(defined(__AVX2__) && defined(__FMA__))
  return 0;  // the plain build: accumulate for every row count
#elif (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return f == Q8_0 ? 6 : 4;
#else
  return f == Q8_0 ? (bytes > LARGE_BYTES ? 12 : 4) : f == Q6_K ? 3 : 2;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
template <int N>
using Index = std::integral_constant<int, N>;

// How far ahead of its dots few_chains asks for weight bytes (an output's next rows: a part's rows lie end to end;
// past the end a prefetch reads nothing). Streaming matrices larger than the caches at one row on an Intel Xeon
// (Sapphire Rapids, 2 threads), the hardware prefetcher alone gave 9-14 GB/s of the 20 a plain read gets; 2 KiB
// ahead 13-17 (1.11-1.65x per matrix; 512 B 0.97-1.22x, 4-8 KiB as 2 KiB). No effect on the bits.
constexpr int64_t PREFETCH_BYTES = 2048;

// Rows r0 .. r0 + R - 1 against one output's weight row: each row's eight-lane float chain into acc[r]. The
// integers and float steps accumulate makes, row by row, so a row's bits do not depend on the others here or
// on the path taken. Always inlined: left to the compiler, its chains went through memory (0.95-0.98x at two rows).
template <int64_t F, int R>
__attribute__((always_inline)) inline void few_chains(const uint8_t* row, int64_t groups, int64_t nblocks,
                                                      const Codes& c, int64_t r0, __m256* acc) {
  constexpr Traits t = traits(F);
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), xq[r] = c.q + (r0 + r) * c.stride;
  for (int64_t gi = 0; gi < groups; ++gi) {
    {  // the weights PREFETCH_BYTES ahead asked for now: one row's dots alone do not keep enough reads in flight
      const int64_t group_bytes = block_elems(F) == 32 ? 8 * block_bytes(F) : block_bytes(F);
      const char* ahead = reinterpret_cast<const char*>(row + gi * group_bytes) + PREFETCH_BYTES;
      for (int64_t line = 0; line < group_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    __m256i p[R][8];
    // Block j of the group against each row: u its codes as unsigned bytes; a signed format puts w's
    // signs on the row's codes; Q6_K's vpmaddwd multiplies by the block's two scales (lanes) as it widens.
    auto dots = [&](int j, __m256i u, __m256i w, __m256i lanes) {
      for (int r = 0; r < R; ++r) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + j * QB));
        if constexpr (t.is_signed) x = _mm256_sign_epi8(x, w);
        if constexpr (F == Q6_K) p[r][j] = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), lanes);
        else p[r][j] = dot_u8s8(u, x);
      }
    };
    const __m256i none = _mm256_setzero_si256();
    __m256 scale, min = _mm256_setzero_ps();
    if constexpr (F == Q8_0 || F == Q4_0 || F == Q5_0) {
      const int64_t first = gi * 8;
      const int count = static_cast<int>(std::min<int64_t>(8, nblocks - first));
      const uint8_t* b = row + first * block_bytes(F);
      // the eight scales gathered in a register: eight 2-byte stores read back as one 16-byte load stall. One row
      // gathers their bits four to a 64-bit integer register instead: its few vector ops per block leave the
      // shuffle port to eight vpinsrw otherwise (1.02-1.07x at one row on SmolLM2's Q8_0 matrices, AVX2 only)
      __m128i halves = _mm_setzero_si128();
      uint64_t low = 0, high = 0;
      auto block = [&](auto index) {
        constexpr int j = decltype(index)::value;
        const uint8_t* bj = b + j * block_bytes(F);
        if constexpr (R > 1) halves = _mm_insert_epi16(halves, half_bits(bj), j);
        else if constexpr (j < 4) low |= uint64_t{half_bits(bj)} << (16 * j);
        else high |= uint64_t{half_bits(bj)} << (16 * (j - 4));
        if constexpr (F == Q8_0) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bj + 2));
          dots(j, _mm256_abs_epi8(w), w, none);
        } else if constexpr (F == Q4_0) {
          dots(j, nibbles16(bj + 2), none, none);
        } else {
          dots(j, q5_codes(bj), none, none);
        }
      };
      if (count == 8) {
        block(Index<0>{}), block(Index<1>{}), block(Index<2>{}), block(Index<3>{});
        block(Index<4>{}), block(Index<5>{}), block(Index<6>{}), block(Index<7>{});
      } else {  // the row's last group: blocks past its end dot to zero, at scale zero
        for (auto& of_row : p)
          for (auto& dot : of_row) dot = none;
        block(Index<0>{});
        if (count > 1) block(Index<1>{});
        if (count > 2) block(Index<2>{});
        if (count > 3) block(Index<3>{});
        if (count > 4) block(Index<4>{});
        if (count > 5) block(Index<5>{});
        if (count > 6) block(Index<6>{});
      }
      if constexpr (R == 1) halves = _mm_set_epi64x(static_cast<int64_t>(high), static_cast<int64_t>(low));
      scale = _mm256_cvtph_ps(halves);
    } else if constexpr (F == Q6_K) {
      const uint8_t* b = row + gi * block_bytes(F);
      scale = _mm256_set1_ps(half(b + 208));
      // The sixteen int8 scales as int16, the even ones in the low half and the odd ones in the high half,
      // so one vpshufb gives block j's pair (2j for its first 16 codes, 2j + 1 for its second).
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
      const __m256i bias = _mm256_set1_epi8(32);
      for (int h = 0; h < 2; ++h) {
        __m256i codes[4];
        q6k_codes(b, h, codes);
        for (int k = 0; k < 4; ++k) {
          const int j = 4 * h + k;
          const __m256i w = _mm256_sub_epi8(codes[k], bias);
          dots(j, _mm256_abs_epi8(w), w, _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<int16_t>((2 * j + 1) << 8 | 2 * j))));
        }
      }
    } else {  // Q4_K, Q5_K
      const uint8_t* b = row + gi * block_bytes(F);
      __m256i scs, mins;
      k_scales_mins(b + 4, scs, mins);
      scale = _mm256_mul_ps(_mm256_set1_ps(half(b)), _mm256_cvtepi32_ps(scs));
      min = _mm256_mul_ps(_mm256_set1_ps(half(b + 2)), _mm256_cvtepi32_ps(mins));
      const uint8_t* qs = b + (F == Q5_K ? 48 : 16);
      [[maybe_unused]] const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      for (int k = 0; k < 4; ++k) {
        __m256i lo, up;
        k_codes<F>(qs, qh, k, lo, up);
        dots(2 * k, lo, none, none);
        dots(2 * k + 1, up, none, none);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t b = (r0 + r) * c.blocks + gi * 8;
      acc[r] = settle<F>(sum_each(p[r]), scale, min, c.scale + b, c.sum + b, c.scaled_sum + b, acc[r]);
      xq[r] += GROUP;
    }
  }
}

// y[r] for each of the rows: their chains' lanes added in lanes_sum's order.
template <int64_t F, int R>
inline void few_dots(const uint8_t* row, int64_t groups, int64_t nblocks, const Codes& c, int64_t r0, float* y) {
  __m256 acc[R];
  few_chains<F, R>(row, groups, nblocks, c, r0, acc);
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    y[r] = lanes_sum(lanes);
  }
}

// Outputs [begin, end) of one part for every row (at most few_rows of them), four rows at a time.
template <int64_t F, typename Y>
void few_outputs(const Codes& c, int64_t rows, const uint8_t* rows_of_part, int64_t first_output, int64_t k, Y* y,
                 int64_t n, int64_t begin, int64_t end) {
  const int64_t nblocks = k / block_elems(F), row_bytes = nblocks * block_bytes(F), groups = c.blocks / 8;
  float out[4];
  // One row: eight outputs' chains summed side by side (lanes_sums8, lanes_sum's additions in registers), not each
  // through eight scalar loads and adds; with the scales gathered in integer registers (few_chains), 1.11-1.20x
  // at one row on SmolLM2's Q8_0 matrices and 1.02-1.12x on Qwen2.5's, the same bits (AVX2-only AMD EPYC).
  if (rows == 1) {
    alignas(32) float lanes[8 * 8], sums[8];
    for (; begin + 8 <= end; begin += 8) {
      for (int i = 0; i < 8; ++i) {
        __m256 acc;
        few_chains<F, 1>(rows_of_part + (begin + i) * row_bytes, groups, nblocks, c, 0, &acc);
        _mm256_store_ps(lanes + 8 * i, acc);
      }
      _mm256_store_ps(sums, lanes_sums8(lanes));
      for (int i = 0; i < 8; ++i) y[first_output + begin + i] = static_cast<Y>(sums[i]);
    }
    for (int64_t o = begin; o < end; ++o) {
      few_dots<F, 1>(rows_of_part + o * row_bytes, groups, nblocks, c, 0, out);
      y[first_output + o] = static_cast<Y>(out[0]);
    }
    return;
  }
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* w = rows_of_part + o * row_bytes;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t count = std::min<int64_t>(4, rows - r0);
      switch (count) {
        case 1: few_dots<F, 1>(w, groups, nblocks, c, r0, out); break;
        case 2: few_dots<F, 2>(w, groups, nblocks, c, r0, out); break;
        case 3: few_dots<F, 3>(w, groups, nblocks, c, r0, out); break;
        default: few_dots<F, 4>(w, groups, nblocks, c, r0, out); break;
      }
      for (int64_t r = 0; r < count; ++r) y[(r0 + r) * n + first_output + o] = static_cast<Y>(out[r]);
    }
  }
}
#endif

}  // namespace block_kernels
