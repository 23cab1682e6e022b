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
//
// The pieces: block_formats.cpp (formats, decoding), block_few.cpp (a decode step's few rows), block_woven.cpp
// (many rows with AVX2), this
// file (the weight's header, the split into tasks, the bindings); native.py compiles them in that order as one
// translation unit.

namespace block_kernels {

constexpr int64_t MAGIC = 0x4b45564230303031;  // "KEVB0001"
constexpr int64_t HEADER_BYTES = 256, MAX_PARTS = 9;
constexpr int64_t TILE = 16;      // outputs per task
// Most rows whose accumulators live together while a weight group is decoded. With AVX-512's pairs, 192 (over
// 128: 1.02-1.09x at 135-176 rows, the stall-free steps; the same beyond). Without, each output rereads the
// chunk's records for the group (RowGroup, 416 bytes a row), which at 64 rows fit a 32 KiB L1: on an AVX2-only
// AMD EPYC 1.03-1.17x over 192 at 135-512 rows (96 and 128 lost on Q6_K); with the records 32, 48 and 96 were no faster.
#if defined(KEV_PAIRS)
constexpr int64_t ROW_CHUNK = 192;
#else
constexpr int64_t ROW_CHUNK = 64;
#endif
constexpr int64_t PAIR_MIN_ROWS = 6;  // fewer rows than this: decoding four outputs' groups costs more than pairs save
constexpr int64_t ROW_BLOCK = 512;    // most rows of one pass over the weight (multiply)

// The int8 dot product this build multiplies with.
inline const char* isa() {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) && defined(__AVX2__) && defined(__FMA__)
  return "avx512-vnni";
#elif defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__)
  return "avx-vnni";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "plain";
#endif
}

struct Part {
  int64_t format, rows, offset, first_output;
};

struct Layout {
  int64_t k;
  std::vector<Part> parts;
};

// Whether this many rows take few_dots on this part (block_few.cpp), not the woven paths.
inline bool takes_few(const Part& part, int64_t k, int64_t rows) {
  return rows <= few_rows(part.format, part.rows * (k / block_elems(part.format)) * block_bytes(part.format));
}

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

// `outputs` outputs' values for a chunk's rows, from their accumulators ([output][row][8]), written to y a row
// at a time through a small buffer: written an output at a time, y's row stride put the chunk's lines into a
// few L1 sets and every store missed. Not inlined, as store_four (block_woven.cpp).
template <typename Y>
__attribute__((noinline)) void store_rows(const float* acc, int64_t count, int64_t outputs, Y* y, int64_t n) {
  float out[ROW_CHUNK][TILE];
  for (int64_t o = 0; o < outputs; ++o) {
    const float* a = acc + o * count * 8;
    int64_t r = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; r + 8 <= count; r += 8) {
      alignas(32) float sums[8];
      _mm256_store_ps(sums, lanes_sums8(a + r * 8));
      for (int i = 0; i < 8; ++i) out[r + i][o] = sums[i];
    }
#endif
    for (; r < count; ++r) out[r][o] = lanes_sum(a + r * 8);
  }
  for (int64_t r = 0; r < count; ++r)
    for (int64_t o = 0; o < outputs; ++o) y[r * n + o] = static_cast<Y>(out[r][o]);
}

// Outputs [begin, end) of one part against every row, a chunk of rows at a time, group by group: each
// weight group is decoded once per call (once per chunk for the pairs), and the chunk's records for that
// group (count x 416 bytes) stay in L1 while the task's outputs use them. Every output keeps its own chains in acc: the order of a
// row's sums is fixed by K alone, whichever path (pairs, woven, accumulate) a chunk takes.
template <int64_t F, typename Y>
void part_outputs(const Codes& c, int64_t rows, const uint8_t* base, const Part& part, int64_t k, Y* y, int64_t n,
                  int64_t begin, int64_t end, Group& g, float* acc, Prepared* prepared) {
  const int64_t nblocks = k / block_elems(F), row_bytes = nblocks * block_bytes(F), groups = c.blocks / 8;
  const uint8_t* rows_of_part = base + part.offset;
#if defined(__AVX2__) && defined(__FMA__)
  if (takes_few(part, k, rows)) return few_outputs<F>(c, rows, rows_of_part, part.first_output, k, y, n, begin, end);
#endif
  // chunks of equal, even size (200 rows: 100 + 100, not 192 + 8; with 128-row chunks, 76 + 76 ran
  // 1.03-1.07x faster on Q5_0 than 128 + 24, the same elsewhere)
  const int64_t chunks = (rows + ROW_CHUNK - 1) / ROW_CHUNK, size = ((rows + chunks - 1) / chunks + 1) / 2 * 2;
#if defined(KEV_WOVEN)
  // Over several chunks, each output's groups are decoded and woven once ([output][group]), not once a chunk:
  // 1.02-1.07x at 100-256 rows on Qwen2.5-0.5B's matrices (AVX2-only AMD EPYC, 2 threads), the same at one
  // chunk. The outputs four_outputs takes in every chunk decode their own, as before.
  const bool reuse = prepared != nullptr && chunks > 1;
  int64_t always_paired = 0;
#if defined(KEV_PAIRS)
  if (std::min(size, rows - (chunks - 1) * size) >= PAIR_MIN_ROWS) always_paired = (end - begin) / 4 * 4;
#endif
  for (int64_t o = begin + always_paired; reuse && o < end; ++o)
    for (int64_t gi = 0; gi < groups; ++gi) {
      Prepared& p = prepared[(o - begin) * groups + gi];
      decode<F>(rows_of_part + o * row_bytes, gi, nblocks, g);
      weave<F>(g, p.woven);
      _mm256_store_ps(p.scale, _mm256_load_ps(g.scale));
      _mm256_store_ps(p.min, _mm256_load_ps(g.min));
    }
  Woven woven;
#endif
  for (int64_t r0 = 0; r0 < rows; r0 += size) {
    const int64_t count = std::min(size, rows - r0);
    int64_t paired = 0;  // outputs begin .. begin+paired-1 take four_outputs
#if defined(KEV_PAIRS)
    if (c.woven != nullptr && count >= PAIR_MIN_ROWS) paired = (end - begin) / 4 * 4;
#endif
    // acc: [output][row][8], a quad [row][pair][16]; woven_rows starts its outputs' chains without reading it
    std::fill(acc, acc + (c.woven != nullptr ? paired : end - begin) * count * 8, 0.f);
    for (int64_t gi = 0; gi < groups; ++gi) {
#if defined(KEV_PAIRS)
      for (int64_t o = begin; o < begin + paired; o += 4)
        four_outputs<F>(c, rows_of_part + o * row_bytes, row_bytes, gi, nblocks, r0, count, acc + (o - begin) * count * 8);
#endif
      for (int64_t o = begin + paired; o < end; ++o) {
        float* out = acc + (o - begin) * count * 8;
#if defined(KEV_WOVEN)
        if (reuse) {
          const Prepared& p = prepared[(o - begin) * groups + gi];
          woven_rows<F>(p.woven, p.scale, p.min, c, r0, count, gi, out);
          continue;
        }
        if (c.woven != nullptr) {
          decode<F>(rows_of_part + o * row_bytes, gi, nblocks, g);
          weave<F>(g, woven);
          woven_rows<F>(woven, g.scale, g.min, c, r0, count, gi, out);
          continue;
        }
#endif
        decode<F>(rows_of_part + o * row_bytes, gi, nblocks, g);
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
    store_rows(acc + paired * count * 8, count, end - begin - paired, y + r0 * n + part.first_output + begin + paired, n);
  }
}

struct Task {
  const Part* part;
  int64_t begin, end;
};

// The next task's weight rows, asked for while this one runs. Many rows read a task's 16 outputs group by
// group, 16 short runs at a time, which the hardware prefetcher does not follow: a weight coming from memory
// (a model larger than the caches) was read a line at a time. 1.03-1.32x at 2-24 rows with cold caches; few
// rows (few_dots) read each output's row straight through and need no help.
inline void prefetch(const Task& task, const uint8_t* base, int64_t k) {
  const int64_t row_bytes = k / block_elems(task.part->format) * block_bytes(task.part->format);
  const uint8_t* first = base + task.part->offset + task.begin * row_bytes;
  for (const uint8_t* p = first; p < first + (task.end - task.begin) * row_bytes; p += 64)
    __builtin_prefetch(p, 0, 3);
}

template <typename Y>
void multiply_rows(const Codes& c, int64_t rows, const uint8_t* base, const Layout& layout, Y* y, int64_t n) {
  std::vector<Task> tasks;
  for (const Part& part : layout.parts)
    for (int64_t r = 0; r < part.rows; r += TILE) tasks.push_back({&part, r, std::min(part.rows, r + TILE)});
  // Many rows claim tasks in runs, each a share of what is left (large first, single ones at the end), so a
  // thread done early takes work from the other's half instead of waiting at the join (a fused q|k|v with a
  // Q8_0 part: 1.06-1.21x at 4-256 rows); few rows, which stream the weight once, split it in halves as
  // before. Which thread computes an output never changes its bits.
  const int64_t total = static_cast<int64_t>(tasks.size()), threads = std::max<int64_t>(1, at::get_num_threads());
  std::atomic<int64_t> next{0};
  const bool claimed = c.woven != nullptr;
  at::parallel_for(0, claimed ? std::min(threads, total) : total, 1, [&](int64_t begin, int64_t end) {
    Group g;
    // uninitialised: part_outputs zeroes what pairs and the plain path read, woven chains start from +0
    const std::unique_ptr<float[]> acc(new float[TILE * ROW_CHUNK * 8]);
#if defined(KEV_WOVEN)
    // where rows come in several chunks (part_outputs), left uninitialised: weave fills what is read
    std::unique_ptr<Prepared[]> prepared(c.woven != nullptr && rows > ROW_CHUNK ? new Prepared[TILE * (c.blocks / 8)] : nullptr);
    Prepared* each = prepared.get();
#else
    Prepared* each = nullptr;
#endif
    auto run_tasks = [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        if (t + 1 < t1 && !takes_few(*tasks[t + 1].part, layout.k, rows)) prefetch(tasks[t + 1], base, layout.k);
        const Part& p = *tasks[t].part;
        auto run = [&](auto format) {
          part_outputs<decltype(format)::value>(c, rows, base, p, layout.k, y, n, tasks[t].begin, tasks[t].end, g, acc.get(), each);
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
    };
    if (!claimed) return run_tasks(begin, end);
    for (;;) {
      const int64_t left = total - next.load(std::memory_order_relaxed);
      const int64_t share = std::max<int64_t>(1, left / (2 * threads)), t0 = next.fetch_add(share);
      if (t0 >= total) return;
      run_tasks(t0, std::min(total, t0 + share));
    }
  });
}

// Rows first..first+rows of x into the same rows of y.
void multiply_block(const torch::Tensor& x, const Layout& layout, const torch::Tensor& packed, int64_t n, int64_t first,
                    int64_t rows, torch::Tensor& y) {
  const int64_t k = layout.k;
  const int64_t blocks = (k + GROUP - 1) / GROUP * 8;
  // uninitialised: quantize_row writes every block of every row, fill_row_group every field read
  const std::unique_ptr<int8_t[]> q(new int8_t[rows * blocks * QB]);
  const std::unique_ptr<float[]> scale(new float[rows * blocks]), scaled(new float[rows * blocks]);
  const std::unique_ptr<int32_t[]> sum(new int32_t[rows * blocks]);
  Codes c{q.get(), scale.get(), sum.get(), scaled.get(), blocks * QB, blocks};
  const int64_t groups = blocks / 8;
  bool q6k = false;
#if defined(KEV_WOVEN)
  std::unique_ptr<RowGroup[]> woven;  // few rows take few_dots, which reads the codes as they are
  if (std::any_of(layout.parts.begin(), layout.parts.end(), [&](const Part& p) { return !takes_few(p, k, rows); })) {
    q6k = std::any_of(layout.parts.begin(), layout.parts.end(), [](const Part& p) { return p.format == Q6_K; });
    woven.reset(new RowGroup[groups * rows]);
    c.woven = woven.get(), c.rows = rows;
  }
#endif
  // each row quantized, then its records woven, in one parallel region
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* codes = q.get() + r * blocks * QB;
      float *s = scale.get() + r * blocks, *ss = scaled.get() + r * blocks;
      int32_t* total = sum.get() + r * blocks;
      if (x.scalar_type() == at::ScalarType::Float)
        quantize_row(x.data_ptr<float>() + (first + r) * k, k, codes, s, total, ss, blocks);
      else
        quantize_row(x.data_ptr<at::BFloat16>() + (first + r) * k, k, codes, s, total, ss, blocks);
#if defined(KEV_WOVEN)
      for (int64_t gi = 0; c.woven != nullptr && gi < groups; ++gi) fill_row_group(c, r, gi, q6k, woven[gi * rows + r]);
#endif
    }
  });
  const auto* base = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == at::ScalarType::Float)
    multiply_rows(c, rows, base, layout, y.data_ptr<float>() + first * n, n);
  else
    multiply_rows(c, rows, base, layout, y.data_ptr<at::BFloat16>() + first * n, n);
}

// Without the GIL (the caller released it). x: [M, K] fp32 or bf16; y takes x's dtype. Many rows go ROW_BLOCK
// at a time: every task reads all of a call's row records, which at 2,048 rows (3.4 MB at K = 896, 16 MB at
// 4,864) came from L3 or memory once per task. A row's bits do not depend on the block it is in.
torch::Tensor multiply(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  const Layout layout = read_header(packed);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == layout.k, "block_linear: x [M, ", layout.k, "] contiguous");
  TORCH_CHECK(layout.parts.back().first_output + layout.parts.back().rows == n, "block_linear: ", n, " outputs asked");
  TORCH_CHECK(x.scalar_type() == at::ScalarType::Float || x.scalar_type() == at::ScalarType::BFloat16,
              "block_linear: fp32 or bf16 rows");
  const int64_t rows = x.size(0);
  auto y = torch::empty({rows, n}, x.options());
  const int64_t pieces = (rows + ROW_BLOCK - 1) / ROW_BLOCK, size = pieces > 0 ? (rows + pieces - 1) / pieces : 0;
  for (int64_t first = 0; first < rows; first += size) multiply_block(x, layout, packed, n, first, std::min(size, rows - first), y);
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
