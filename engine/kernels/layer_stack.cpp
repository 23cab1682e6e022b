// A decoder's whole layer stack over one step's rows in one call, for fp32 and bf16 on the CPU.
//
// Python's forward (engine/model/transformer.py) makes about 18 calls per layer; at one decode row each
// costs more than its arithmetic, and a step of 30 layers spent ~3 ms of its ~19 between the matmuls.
// Here the same layer runs as a C++ loop over the same kernels: row_kernels::multiply (row_linear.cpp),
// paged::attend (paged_decode.cpp) and this file's RMSNorm and SwiGLU, all compiled into this one module,
// with the glue between them (bias, RoPE, the KV write, SwiGLU, residuals) written to round exactly as
// the torch ops it replaces. A row's bits are the same through this stack and through the Python forward
// (tests/test_layer_stack.py), so which one runs a step never shows in an answer.
//
// Every row attends as a decode of its own position, reading its keys from the cache in place
// (engine/kernels/rowwise.py); the caller passes each row's block table and visible length.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace stack {

// A layer's tensors in the order engine/kernels/layer_stack.py lists them; absent ones are empty.
enum Weight { INPUT_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, O_PROJ, POST_NORM, GATE_UP, DOWN, PER_LAYER };

constexpr int64_t MAX_HEAD_DIM = 256;
constexpr int64_t ROW_GRAIN = 16;  // rows per task for the per-row glue: a decode row alone stays on one thread

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// torch's `a + b`: the sum in fp32, rounded once to T (c10::BFloat16 rounds to nearest even, as torch does).
template <typename T>
void add_into(T* a, const T* b, int64_t count) {
  at::parallel_for(0, count, 1 << 15, [&](int64_t begin, int64_t end) {  // a decode row stays on one thread
    for (int64_t i = begin; i < end; ++i) a[i] = static_cast<T>(widen(a[i]) + widen(b[i]));
  });
}

// transformers' `x * cos + rotate_half(x) * sin` as engine/model/layers.py's apply_rope computes it: each
// product rounded to T, then their sum (rotate_half(x) * sin == roll(x, D/2) * signed_sin, bit for bit).
// The file is compiled with -ffp-contract=off, so no product and sum fuse into one rounding.
template <typename T>
void rope(T* heads, int64_t count, int64_t dim, const T* cos, const T* sin_signed) {
  const int64_t half = dim / 2;
  float saved[MAX_HEAD_DIM];
  for (int64_t h = 0; h < count; ++h) {
    T* x = heads + h * dim;
    for (int64_t d = 0; d < dim; ++d) saved[d] = widen(x[d]);
    // The two halves apart, so each loop vectorises: d < half turns with d + half, the rest with d - half.
    for (int64_t d = 0; d < half; ++d)
      x[d] = static_cast<T>(widen(static_cast<T>(saved[d] * widen(cos[d]))) +
                            widen(static_cast<T>(saved[d + half] * widen(sin_signed[d]))));
    for (int64_t d = half; d < dim; ++d)
      x[d] = static_cast<T>(widen(static_cast<T>(saved[d] * widen(cos[d]))) +
                            widen(static_cast<T>(saved[d - half] * widen(sin_signed[d]))));
  }
}

// SwiGLU's silu(gate) * up for rows [gate | up] of 2 * width: silu rounded to T, then the product, as
// transformers' act_fn(gate_proj(x)) * up_proj(x) rounds.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> silu(width);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * width;
      const T* up = gate + width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = widen(gate[i]);
        silu[i] = g / (1.0f + paged::exp_clamped(-g));  // beyond [-87, 88] silu is 0 or g anyway
      }
      for (int64_t i = 0; i < width; ++i) out[r * width + i] = static_cast<T>(widen(static_cast<T>(silu[i])) * widen(up[i]));
    }
  });
}

// transformers' RMSNorm in one call: per row, in fp32, x / sqrt(mean(x^2) + eps), then times the weight; for
// bf16 rows the normalised value is rounded to bf16 before the product and the product again (transformers'
// two roundings). The sum of squares runs left to right, so a row's result depends on that row alone. torch
// needs several calls per norm (in bf16 ~8: to float, norm, back, multiply), which at a decode step's single
// row cost more than the arithmetic; a step makes 61.
template <typename T>
void rms_norm_rows(const T* in, const T* w, T* out, int64_t rows, int64_t width, float epsilon) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = in + r * width;
      float squares = 0.0f;
      for (int64_t i = 0; i < width; ++i) {
        const float value = static_cast<float>(row[i]);
        squares += value * value;
      }
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(width) + epsilon);
      T* dest = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        // static_cast<T> rounds to bf16 (nearest even) where T is bf16, and is exact for float.
        const float normed = static_cast<float>(static_cast<T>(static_cast<float>(row[i]) * scale));
        dest[i] = static_cast<T>(static_cast<float>(w[i]) * normed);
      }
    }
  });
}

torch::Tensor normed(const torch::Tensor& x, const torch::Tensor& weight, float eps) {
  auto y = torch::empty_like(x);
  const int64_t rows = x.size(0), width = x.size(1);
  if (x.scalar_type() == at::ScalarType::Float)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, width, eps);
  else
    rms_norm_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                               y.data_ptr<at::BFloat16>(), rows, width, eps);
  return y;
}

// Where a step's rows attend: each row's position, cache slot, block table and visible length.
struct Rows {
  const int64_t* positions;
  const int64_t* slots;
  torch::Tensor table, lengths;
  int64_t block_size;
  double scale;
};

struct Shape {
  int64_t heads, kv_heads, dim, intermediate;
  float eps;
};

// n values into a cache row: as they are, or fp32 rounded to an fp16 cache's values (to nearest even, as
// torch's .to(torch.float16) rounds, so the Python forward writes the same bits).
inline void store_row(float* out, const float* x, int64_t n) { std::memcpy(out, x, n * sizeof(float)); }
inline void store_row(at::BFloat16* out, const at::BFloat16* x, int64_t n) { std::memcpy(out, x, n * sizeof(*x)); }
inline void store_row(at::Half* out, const float* x, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) out[i] = static_cast<at::Half>(x[i]);
}

// From a row's fresh qkv: q and k normalised per head where the model says so (Qwen3), rotated to the
// row's position, k and v written to the row's slot (C: the cache's type), q copied out for attention.
template <typename T, typename C>
void place_row(T* qkv, const Shape& s, const torch::Tensor* w, const T* cos, const T* sin_signed,
               C* k_cache, C* v_cache, int64_t slot, T* q_out) {
  const int64_t q_size = s.heads * s.dim, kv_size = s.kv_heads * s.dim;
  T* q = qkv;
  T* k = qkv + q_size;
  const T* v = k + kv_size;
  if (w[Q_NORM].numel() > 0) {
    rms_norm_rows(q, w[Q_NORM].data_ptr<T>(), q, s.heads, s.dim, s.eps);
    rms_norm_rows(k, w[K_NORM].data_ptr<T>(), k, s.kv_heads, s.dim, s.eps);
  }
  rope(q, s.heads + s.kv_heads, s.dim, cos, sin_signed);  // q and k lie side by side
  store_row(k_cache + slot * kv_size, k, kv_size);
  store_row(v_cache + slot * kv_size, v, kv_size);
  std::memcpy(q_out, q, q_size * sizeof(T));
}

template <typename T, typename C>
void attention_half(torch::Tensor& hidden, const torch::Tensor* w, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const Rows& rows, const Shape& s, const torch::Tensor& cos,
                    const torch::Tensor& sin_signed, int64_t window) {
  const int64_t count = hidden.size(0), n = (s.heads + 2 * s.kv_heads) * s.dim;
  auto qkv = row_kernels::multiply(normed(hidden, w[INPUT_NORM], s.eps), w[QKV], n);
  if (w[QKV_BIAS].numel() > 0)
    for (int64_t r = 0; r < count; ++r) add_into(qkv.data_ptr<T>() + r * n, w[QKV_BIAS].data_ptr<T>(), n);
  auto q = torch::empty({count, s.heads, s.dim}, hidden.options());
  at::parallel_for(0, count, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = rows.positions[r];
      place_row<T, C>(qkv.data_ptr<T>() + r * n, s, w, cos.data_ptr<T>() + p * s.dim,
                      sin_signed.data_ptr<T>() + p * s.dim, k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), rows.slots[r],
                      q.data_ptr<T>() + r * s.heads * s.dim);
    }
  });
  auto out = paged::attend(q, k_cache, v_cache, rows.table, rows.lengths, rows.block_size, rows.scale, window, 0.0,
                           c10::nullopt, c10::nullopt);
  auto projected = row_kernels::multiply(out.view({count, s.heads * s.dim}), w[O_PROJ], hidden.size(1));
  add_into(hidden.data_ptr<T>(), projected.data_ptr<T>(), hidden.numel());
}

template <typename T>
void mlp_half(torch::Tensor& hidden, const torch::Tensor* w, const Shape& s) {
  const int64_t count = hidden.size(0);
  auto gate_up = row_kernels::multiply(normed(hidden, w[POST_NORM], s.eps), w[GATE_UP], 2 * s.intermediate);
  auto act = torch::empty({count, s.intermediate}, hidden.options());
  silu_mul_rows(gate_up.data_ptr<T>(), act.data_ptr<T>(), count, s.intermediate);
  auto down = row_kernels::multiply(act, w[DOWN], hidden.size(1));
  add_into(hidden.data_ptr<T>(), down.data_ptr<T>(), hidden.numel());
}

}  // namespace stack

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  using stack::rms_norm_rows;
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: rows and weight of one dtype");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1, "rms_norm: contiguous");
  const int64_t width = weight.size(0);
  TORCH_CHECK(x.size(-1) == width, "rms_norm: rows of ", x.size(-1), " against a weight of ", width);
  auto y = torch::empty_like(x);
  const int64_t rows = x.numel() / width;
  const float epsilon = static_cast<float>(eps);
  if (x.scalar_type() == at::ScalarType::Float) {
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, width, epsilon);
  } else {
    TORCH_CHECK(x.scalar_type() == at::ScalarType::BFloat16, "rms_norm: fp32 or bf16 only");
    rms_norm_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows,
                  width, epsilon);
  }
  return y;
}

// silu(gate) * up for rows [gate | up] (fp32 or bf16): the Python forward's SwiGLU, the stack's own.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_mul: contiguous rows [gate | up]");
  const int64_t width = gate_up.size(-1) / 2, rows = width ? gate_up.numel() / (2 * width) : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width;
  auto out = torch::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == at::ScalarType::Float)
    stack::silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, width);
  else {
    TORCH_CHECK(gate_up.scalar_type() == at::ScalarType::BFloat16, "silu_mul: fp32 or bf16 only");
    stack::silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, width);
  }
  return out;
}

// hidden [T, width] through every layer. weights: PER_LAYER tensors per layer (engine/kernels/layer_stack.py
// lists them); caches: each layer's keys then values [slots, kv_heads, dim]; positions and slots [T];
// table [T, blocks] and lengths [T]: each row's own blocks and how many of its positions it sees.
torch::Tensor layer_stack(torch::Tensor hidden, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> caches,
                          torch::Tensor positions, torch::Tensor cos, torch::Tensor sin_signed, torch::Tensor slots,
                          torch::Tensor table, torch::Tensor lengths, int64_t block_size, int64_t heads,
                          int64_t kv_heads, int64_t intermediate, double scale, double eps,
                          std::vector<int64_t> windows) {
  using namespace stack;
  const int64_t layers = static_cast<int64_t>(weights.size()) / PER_LAYER;
  TORCH_CHECK(weights.size() % PER_LAYER == 0 && caches.size() == 2 * weights.size() / PER_LAYER &&
              static_cast<int64_t>(windows.size()) == layers,
              "layer_stack: ", PER_LAYER, " weights, 2 caches and a sliding window (0: none) per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.device().is_cpu(), "layer_stack: hidden [T, width]");
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::ScalarType::Float || dtype == at::ScalarType::BFloat16, "layer_stack: fp32 or bf16 only");
  const int64_t count = hidden.size(0), dim = caches.empty() ? 0 : caches[0].size(2);
  TORCH_CHECK(dim > 0 && dim <= MAX_HEAD_DIM && dim % 2 == 0, "layer_stack: head size ", dim);
  for (const auto& t : {positions, slots, lengths})
    TORCH_CHECK(t.scalar_type() == torch::kLong && t.is_contiguous() && t.numel() == count, "layer_stack: [T] int64");
  // fp32 rows may keep an fp16 cache (kv_cache.dtype fp16)
  const bool half_cache =
      !caches.empty() && caches[0].scalar_type() == at::ScalarType::Half && dtype == at::ScalarType::Float;
  for (const auto& c : caches)
    TORCH_CHECK((c.scalar_type() == dtype || (half_cache && c.scalar_type() == at::ScalarType::Half)) &&
                    c.is_contiguous() && c.dim() == 3 && c.size(1) == kv_heads && c.size(2) == dim,
                "layer_stack: caches [slots, kv_heads, dim] of the rows' dtype, or fp16 under fp32 rows");
  TORCH_CHECK(cos.scalar_type() == dtype && sin_signed.scalar_type() == dtype && cos.is_contiguous() &&
              sin_signed.is_contiguous() && cos.size(-1) == dim, "layer_stack: rotary tables [positions, dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {  // what paged::attend does not check itself
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "layer_stack: row ", r, " at position ", pos[r]);
    TORCH_CHECK(slot[r] >= 0 && slot[r] < caches[0].size(0), "layer_stack: row ", r, " names slot ", slot[r]);
  }
  const Rows rows{pos, slot, table, lengths, block_size, scale};
  const Shape shape{heads, kv_heads, dim, intermediate, static_cast<float>(eps)};
  auto h = hidden.clone();
  if (count == 0) return h;
  pybind11::gil_scoped_release no_gil;  // other Python threads (the worker's event loop) run meanwhile
  for (int64_t layer = 0; layer < layers; ++layer) {
    const torch::Tensor* w = weights.data() + layer * PER_LAYER;
    const auto& k_cache = caches[2 * layer];
    const auto& v_cache = caches[2 * layer + 1];
    if (dtype == at::ScalarType::Float) {
      if (half_cache)
        attention_half<float, at::Half>(h, w, k_cache, v_cache, rows, shape, cos, sin_signed, windows[layer]);
      else
        attention_half<float, float>(h, w, k_cache, v_cache, rows, shape, cos, sin_signed, windows[layer]);
      mlp_half<float>(h, w, shape);
    } else {
      attention_half<at::BFloat16, at::BFloat16>(h, w, k_cache, v_cache, rows, shape, cos, sin_signed, windows[layer]);
      mlp_half<at::BFloat16>(h, w, shape);
    }
  }
  return h;
}
