// y = x @ W^T for fp32, bf16 and int8 weights, with every output element reduced in one order fixed by K alone.
//
// W arrives repacked (engine/kernels/row_linear.py) in panels of 16 output columns:
//   fp32: [panels, K, 16]            element (k, c) of panel p at (p * K + k) * 16 + c
//   bf16: [panels, K2 / 2, 16, 2]    K2 = K rounded up to even; (k, c) at ((p * K2/2 + k/2) * 16 + c) * 2 + k % 2
//   int8: [panels, K + 4, 16]        (k, c) at (p * (K + 4) + k) * 16 + c; then the panel's 16 fp32 scales
// so one read of a panel serves every row of the call, 16 columns per vector.
//
// Output element (row, col) is accumulated by one chain over k = 0 .. K-1 (bf16: over k pairs), starting
// from zero, by the same instruction in every tile shape. Rows and panels only choose which chains run side
// by side; the work is split between threads by output-column panels. So a row's bits never depend on the
// number of rows in the call, its place among them, or the thread count. Which chain instruction is used
// (AVX-512 fma, vdpbf16ps, AVX2 fma, plain multiply-then-add) is fixed when this file is compiled for the
// host, so paths may differ from each other in the last bits, never within one build.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>  // declares every ISA's intrinsics; only the build's own are used
#endif

namespace block_kernels {  // block_linear.cpp: weights kept in GGUF's block formats (a uint8 tensor)
torch::Tensor multiply(const torch::Tensor& x, const torch::Tensor& packed, int64_t n);
}

namespace row_kernels {

constexpr int PANEL = 16;

// fp32 -> bf16, round to nearest even (NaN stays a quiet NaN), the same in every build.
inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float from_bf16(uint16_t half) {
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Writes one row's 16 accumulated columns (of which `count` are real) as float or bf16.
inline void store_row(const float* lanes, float* out, int count) { std::memcpy(out, lanes, count * sizeof(float)); }
inline void store_row(const float* lanes, c10::BFloat16* out, int count) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(out);
  for (int c = 0; c < count; ++c) bits[c] = to_bf16(lanes[c]);
}

// The vector operations of one instruction set. A panel row (16 columns) is PER vectors of LANES floats.
#if defined(__AVX512F__)
struct Isa {
  using V = __m512;
  static constexpr int LANES = 16, PER = 1, ROWS_F32 = 6, ROWS_BF16 = 4, PANELS = 4;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V splat(float v) { return _mm512_set1_ps(v); }
  static V madd(V x, V w, V acc) { return _mm512_fmadd_ps(x, w, acc); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void put(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V widen8(const int8_t* p) {  // 16 int8 weights as fp32, exactly
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // 16 columns' (k, k+1) bf16 pairs -> k's 16 values and k+1's, exactly (bf16 is fp32's top half).
  static void widen(const uint16_t* p, V& even, V& odd) {
    const __m512i raw = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static const char* name() {
#if defined(__AVX512BF16__)
    return "avx512-bf16";
#else
    return "avx512";
#endif
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Isa {
  using V = __m256;
  static constexpr int LANES = 8, PER = 2, ROWS_F32 = 6, ROWS_BF16 = 4, PANELS = 1;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V splat(float v) { return _mm256_set1_ps(v); }
  static V madd(V x, V w, V acc) { return _mm256_fmadd_ps(x, w, acc); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void put(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V widen8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void widen(const uint16_t* p, V& even, V& odd) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static const char* name() { return "avx2"; }
};
#else
// Plain C++: 16 lanes the compiler may vectorise. The file is compiled with -ffp-contract=off, so a
// multiply-add stays a rounded multiply then a rounded add wherever the compiler puts it.
struct Isa {
  struct V {
    float v[16];
  };
  static constexpr int LANES = 16, PER = 1, ROWS_F32 = 4, ROWS_BF16 = 4, PANELS = 1;
  static V zero() { return V{}; }
  static V load(const float* p) {
    V out;
    std::memcpy(out.v, p, sizeof out.v);
    return out;
  }
  static V splat(float x) {
    V out;
    for (int l = 0; l < 16; ++l) out.v[l] = x;
    return out;
  }
  static V madd(const V& x, const V& w, V acc) {
    for (int l = 0; l < 16; ++l) acc.v[l] = acc.v[l] + x.v[l] * w.v[l];
    return acc;
  }
  static void put(float* p, const V& v) { std::memcpy(p, v.v, sizeof v.v); }
  static V mul(const V& a, const V& b) {
    V out;
    for (int l = 0; l < 16; ++l) out.v[l] = a.v[l] * b.v[l];
    return out;
  }
  static V widen8(const int8_t* p) {
    V out;
    for (int l = 0; l < 16; ++l) out.v[l] = static_cast<float>(p[l]);
    return out;
  }
  static void widen(const uint16_t* p, V& even, V& odd) {
    for (int l = 0; l < 16; ++l) {
      even.v[l] = from_bf16(p[2 * l]);
      odd.v[l] = from_bf16(p[2 * l + 1]);
    }
  }
  static const char* name() { return "plain"; }
};
#endif

// Where a tile reads and writes: R rows of x from `x` (stride ldx), P panels from `w` (stride
// panel_stride elements), into y (stride ldy) from column `col`, of which `cols` are real.
template <typename X, typename W, typename Y>
struct Tile {
  const X* x;
  int64_t ldx;
  const W* w;
  int64_t panel_stride;
  int64_t k;  // fp32: K; bf16: K2 / 2 pairs
  Y* y;
  int64_t ldy;
  int64_t col;
  int64_t cols;
  const W* next;  // the panels read after these, prefetched meanwhile (nullptr: none)
  int64_t fetch_from, fetch_to;  // the steps of `next` this tile prefetches
};

// Asks for the line holding p in L2: the next panel group streams in from memory while this one is used.
inline void ahead(const void* p) {
#if defined(__x86_64__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// One 64-byte line per panel per step of the chain (16 fp32 columns, or 16 columns' bf16 pairs).
template <int P, typename X, typename W, typename Y>
inline void fetch_next(const Tile<X, W, Y>& t, int64_t step) {
  if (t.next == nullptr || step < t.fetch_from || step >= t.fetch_to) return;
  for (int p = 0; p < P; ++p) ahead(t.next + p * t.panel_stride + step * (64 / sizeof(W)));
}

// Writes R x P panels of accumulators to y, cutting the last panel at the matrix's width.
template <int R, int P, typename X, typename W, typename Y>
inline void write(typename Isa::V (&acc)[R][P * Isa::PER], const Tile<X, W, Y>& t) {
  float lanes[PANEL];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      const int64_t col = t.col + p * PANEL;
      const int count = static_cast<int>(std::min<int64_t>(PANEL, t.cols - p * PANEL));
      if (count <= 0) continue;
      if constexpr (std::is_same_v<Y, float>) {
        if (count == PANEL) {  // straight into y: a memcpy per 64 bytes took 3% of a prompt-heavy fp32 run
          for (int h = 0; h < Isa::PER; ++h) Isa::put(t.y + r * t.ldy + col + h * Isa::LANES, acc[r][p * Isa::PER + h]);
          continue;
        }
      }
      for (int h = 0; h < Isa::PER; ++h) Isa::put(lanes + h * Isa::LANES, acc[r][p * Isa::PER + h]);
      store_row(lanes, t.y + r * t.ldy + col, count);
    }
}

// fp32 weights, fp32 rows: acc[r][c] = fma(x[r][k], w[k][c], acc[r][c]) for k = 0 .. K-1.
template <int R, int P, typename Y>
void tile_f32(const Tile<float, float, Y>& t) {
  constexpr int N = P * Isa::PER;
  typename Isa::V acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) acc[r][i] = Isa::zero();
  for (int64_t k = 0; k < t.k; ++k) {
    fetch_next<P>(t, k);
    typename Isa::V w[N];
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < Isa::PER; ++h) w[p * Isa::PER + h] = Isa::load(t.w + p * t.panel_stride + k * PANEL + h * Isa::LANES);
    for (int r = 0; r < R; ++r) {
      const typename Isa::V x = Isa::splat(t.x[r * t.ldx + k]);
      for (int i = 0; i < N; ++i) acc[r][i] = Isa::madd(x, w[i], acc[r][i]);
    }
  }
  write<R, P>(acc, t);
}

// bf16 weights widened to fp32, rows already in fp32: per pair j, k = 2j's multiply-add then k = 2j+1's.
template <int R, int P, typename Y>
void tile_bf16_widened(const Tile<float, uint16_t, Y>& t) {
  constexpr int N = P * Isa::PER;
  typename Isa::V acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) acc[r][i] = Isa::zero();
  for (int64_t j = 0; j < t.k; ++j) {
    fetch_next<P>(t, j);
    typename Isa::V even[N], odd[N];
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < Isa::PER; ++h)
        Isa::widen(t.w + p * t.panel_stride + j * 2 * PANEL + h * 2 * Isa::LANES, even[p * Isa::PER + h],
                   odd[p * Isa::PER + h]);
    for (int r = 0; r < R; ++r) {
      const typename Isa::V x0 = Isa::splat(t.x[r * t.ldx + 2 * j]), x1 = Isa::splat(t.x[r * t.ldx + 2 * j + 1]);
      for (int i = 0; i < N; ++i) acc[r][i] = Isa::madd(x1, odd[i], Isa::madd(x0, even[i], acc[r][i]));
    }
  }
  write<R, P>(acc, t);
}

// int8 weights (a panel's K rows of 16 int8, then its 16 fp32 column scales), rows in fp32: the chain
// of multiply-adds over k on the int8 values widened exactly, then one multiply by the column's scale.
template <int R, int P, typename Y>
void tile_int8(const Tile<float, int8_t, Y>& t) {
  constexpr int N = P * Isa::PER;
  typename Isa::V acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) acc[r][i] = Isa::zero();
  for (int64_t k = 0; k < t.k; ++k) {
    if (k % 4 == 0) fetch_next<P>(t, k / 4);  // a 64-byte line holds four k of a panel
    typename Isa::V w[N];
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < Isa::PER; ++h) w[p * Isa::PER + h] = Isa::widen8(t.w + p * t.panel_stride + k * PANEL + h * Isa::LANES);
    for (int r = 0; r < R; ++r) {
      const typename Isa::V x = Isa::splat(t.x[r * t.ldx + k]);
      for (int i = 0; i < N; ++i) acc[r][i] = Isa::madd(x, w[i], acc[r][i]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int h = 0; h < Isa::PER; ++h) {
      float scale[Isa::LANES];
      std::memcpy(scale, t.w + p * t.panel_stride + t.k * PANEL + h * Isa::LANES * sizeof(float), sizeof scale);
      for (int r = 0; r < R; ++r) acc[r][p * Isa::PER + h] = Isa::mul(acc[r][p * Isa::PER + h], Isa::load(scale));
    }
  write<R, P>(acc, t);
}

#if defined(__AVX512BF16__)
// bf16 weights and rows with vdpbf16ps: per pair j, one instruction adds both products to each column.
template <int R, int P, typename Y>
void tile_bf16_dot(const Tile<uint16_t, uint16_t, Y>& t) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t j = 0; j < t.k; ++j) {
    fetch_next<P>(t, j);
    __m512bh w[P];
    for (int p = 0; p < P; ++p) w[p] = (__m512bh)_mm512_loadu_si512(t.w + p * t.panel_stride + j * 2 * PANEL);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, t.x + r * t.ldx + 2 * j, sizeof pair);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], x, w[p]);
    }
  }
  write<R, P>(acc, t);
}
#endif

// Calls Kernel's tile<r, p> for a tile's actual row and panel counts (r <= R, p <= P).
template <int R, int P, typename Kernel, typename T>
inline void dispatch(int rows, int panel_count, const T& t) {
  if constexpr (R > 1) {
    if (rows < R) return dispatch<R - 1, P, Kernel>(rows, panel_count, t);
  }
  if constexpr (P > 1) {
    if (panel_count < P) return dispatch<R, P - 1, Kernel>(rows, panel_count, t);
  }
  Kernel::template call<R, P>(t);
}

// Bytes of x rows a pass over the panels keeps in L2: half the core's L2 (the other half holds the panels
// being read), at least 256 KiB. More rows are taken in chunks, each a pass over every panel. Sized from
// the cache, not fixed: on a 1 MiB L2 (AMD EPYC here) a fixed 256 KiB split 64 rows of the 1,536-wide
// down projection into two passes, and one pass made the four SmolLM2 matrices 1.16x faster at 64 rows.
inline int64_t row_chunk_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // 0 or -1 where the system does not say
    return std::max<int64_t>(256 * 1024, l2 > 0 ? l2 / 2 : 0);
  }();
  return bytes;
}

// Every row of x against panels [begin, end): groups of up to P panels, each read once per chunk of rows
// and used from cache by the chunk's tiles of R rows.
template <int R, int P, typename Kernel, typename X, typename W, typename Y>
void panels(const Tile<X, W, Y>& t, int64_t rows, int64_t n, int64_t begin, int64_t end) {
  const int64_t chunk = std::max<int64_t>(R, row_chunk_bytes() / (t.ldx * static_cast<int64_t>(sizeof(X))) / R * R);
  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
    const int64_t chunk_rows = std::min(chunk, rows - c0), blocks = (chunk_rows + R - 1) / R;
    for (int64_t p0 = begin; p0 < end; p0 += P) {
      const int pc = static_cast<int>(std::min<int64_t>(P, end - p0));
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t r0 = c0 + block * R;
        Tile<X, W, Y> at = t;
        at.x = t.x + r0 * t.ldx;
        at.w = t.w + p0 * t.panel_stride;
        at.y = t.y + r0 * t.ldy;
        at.col = p0 * PANEL;
        at.cols = n - at.col;
        // With more than one row block the next group is fetched while this one is used, a share of it
        // per row block, so the fetch does not crowd the rows' working set out of L1 in one block. A
        // single block streams the weights at memory speed, which the hardware's prefetcher keeps up
        // with alone (measured: software prefetch made one row 10-20% slower, and 64 rows 12-25% faster).
        at.next = blocks > 1 && p0 + P < end ? t.w + (p0 + P) * t.panel_stride : nullptr;
        const int64_t lines = sizeof(W) == 1 ? (t.k + 3) / 4 : t.k;  // 64-byte steps of a panel
        at.fetch_from = lines * block / blocks;
        at.fetch_to = lines * (block + 1) / blocks;
        dispatch<R, P, Kernel>(static_cast<int>(std::min<int64_t>(R, rows - r0)), pc, at);
      }
    }
  }
}

struct F32 {
  template <int r, int p, typename Y>
  static void call(const Tile<float, float, Y>& t) { tile_f32<r, p>(t); }
};
struct Bf16Widened {
  template <int r, int p, typename Y>
  static void call(const Tile<float, uint16_t, Y>& t) { tile_bf16_widened<r, p>(t); }
};
struct Int8 {
  template <int r, int p, typename Y>
  static void call(const Tile<float, int8_t, Y>& t) { tile_int8<r, p>(t); }
};
#if defined(__AVX512BF16__)
struct Bf16Dot {
  template <int r, int p, typename Y>
  static void call(const Tile<uint16_t, uint16_t, Y>& t) { tile_bf16_dot<r, p>(t); }
};
#endif

// The panels split into contiguous ranges, one per task; a range's size never changes a column's arithmetic.
template <int R, typename Kernel, typename X, typename W, typename Y>
void run(const Tile<X, W, Y>& t, int64_t rows, int64_t n, int64_t panel_count) {
  at::parallel_for(0, panel_count, Isa::PANELS, [&](int64_t begin, int64_t end) {
    panels<R, Isa::PANELS, Kernel>(t, rows, n, begin, end);
  });
}

// x [M, K] (fp32 with fp32 weights; bf16 with bf16 weights, K even) times the packed weight of n outputs.
// int8 weights [panels, K + 4, 16]: K rows of 16 int8 columns, then 64 bytes of the 16 columns' fp32 scales.
// fp32 rows are read as they are, bf16 rows widened to fp32 once (exact); y takes the rows' dtype.
torch::Tensor multiply_int8(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, torch::Tensor& y) {
  const int64_t k = x.size(1), rows = x.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k + 4 && packed.size(2) == PANEL, "row_linear: int8 layout");
  TORCH_CHECK(x.scalar_type() == at::ScalarType::Float || x.scalar_type() == at::ScalarType::BFloat16,
              "row_linear: int8 weights take fp32 or bf16 rows");
  const torch::Tensor wide = x.scalar_type() == at::ScalarType::Float ? x : x.to(at::ScalarType::Float);
  const auto* w = packed.data_ptr<int8_t>();
  if (x.scalar_type() == at::ScalarType::Float) {
    Tile<float, int8_t, float> t{wide.data_ptr<float>(), k, w, (k + 4) * PANEL, k, y.data_ptr<float>(), n, 0, n, nullptr, 0, 0};
    run<Isa::ROWS_F32, Int8>(t, rows, n, packed.size(0));
  } else {
    Tile<float, int8_t, c10::BFloat16> t{wide.data_ptr<float>(), k, w, (k + 4) * PANEL, k, y.data_ptr<at::BFloat16>(), n, 0, n, nullptr, 0, 0};
    run<Isa::ROWS_F32, Int8>(t, rows, n, packed.size(0));
  }
  return y;
}

// Without the GIL: the caller (row_linear below, or the layer stack) has released it.
torch::Tensor multiply(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  if (packed.scalar_type() == at::ScalarType::Byte) return block_kernels::multiply(x, packed, n);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous(), "row_linear: x [M, K] contiguous");
  const int64_t rows = x.size(0), panel_count = packed.size(0);
  TORCH_CHECK(panel_count * PANEL >= n && n > 0, "row_linear: ", n, " outputs do not fit ", panel_count, " panels");
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0) return y;
  if (packed.scalar_type() == at::ScalarType::Char) return multiply_int8(x, packed, n, y);
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "row_linear: x and the weight must share a dtype");
#if !defined(__AVX512BF16__)
  // bf16 rows widened to fp32 once here, not in every panel task.
  const torch::Tensor wide = x.scalar_type() == at::ScalarType::BFloat16 ? x.to(at::ScalarType::Float) : x;
#endif
  if (x.scalar_type() == at::ScalarType::Float) {
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == PANEL, "row_linear: fp32 layout");
    const int64_t k = x.size(1);
    Tile<float, float, float> t{x.data_ptr<float>(), k, packed.data_ptr<float>(), k * PANEL, k, y.data_ptr<float>(), n, 0, n, nullptr, 0, 0};
    run<Isa::ROWS_F32, F32>(t, rows, n, panel_count);
    return y;
  }
  TORCH_CHECK(x.scalar_type() == at::ScalarType::BFloat16, "row_linear: fp32 or bf16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(1) && packed.size(2) == PANEL && packed.size(3) == 2,
              "row_linear: bf16 layout (K even)");
  const int64_t pairs = packed.size(1);
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* out = y.data_ptr<at::BFloat16>();
#if defined(__AVX512BF16__)
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  Tile<uint16_t, uint16_t, c10::BFloat16> t{xs, 2 * pairs, w, pairs * 2 * PANEL, pairs, out, n, 0, n, nullptr, 0, 0};
  run<Isa::ROWS_F32, Bf16Dot>(t, rows, n, panel_count);
#else
  Tile<float, uint16_t, c10::BFloat16> t{wide.data_ptr<float>(), 2 * pairs, w, pairs * 2 * PANEL, pairs, out, n, 0, n, nullptr, 0, 0};
  run<Isa::ROWS_BF16, Bf16Widened>(t, rows, n, panel_count);
#endif
  return y;
}

}  // namespace row_kernels

torch::Tensor row_linear(torch::Tensor x, torch::Tensor packed, int64_t n) {
  pybind11::gil_scoped_release no_gil;  // other Python threads (the worker's event loop) run meanwhile
  return row_kernels::multiply(x, packed, n);
}

// The instruction set this build multiplies with: avx512-bf16, avx512, avx2 or plain.
std::string row_linear_isa() { return row_kernels::Isa::name(); }
