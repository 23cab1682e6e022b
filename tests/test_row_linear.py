"""row_linear: F.linear's results within rounding, and a row's bits the same alone and inside any call.

Each build the CPUs Kev meets would run is checked here: the host's (AVX-512 with vdpbf16ps on a CPU
with AVX512_BF16), the one without AVX-512 (AVX2) and the plain C++ one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import row_linear
from engine.kernels.cpu_features import cpu_flags
from engine.kernels.row_linear import RowWeight

ROWS = (1, 2, 3, 7, 16, 33, 64, 200)
# SmolLM2-135M's matrices [out, in]: hidden 576, q 576, kv 192, intermediate 1536, vocabulary 49152, the
# fused q+k+v and gate+up Kev multiplies by, and an odd shape (a partial panel, an odd bf16 K).
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (960, 576), (3072, 576), (37, 101)]
BUILDS = {"host": row_linear.CFLAGS, "no-avx512": row_linear.NO_AVX512, "plain": row_linear.PLAIN}
DTYPES = (torch.float32, torch.bfloat16)


def build(name: str):
    module = row_linear.compiled(BUILDS[name])
    assert module is not None, f"the {name} build of row_linear did not compile"
    return module


def weight_and_rows(shape, dtype, rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
    return weight, torch.randn(rows, shape[1], generator=generator).to(dtype)


def expected_isa() -> str:
    flags = cpu_flags()
    if "avx512f" in flags:
        return "avx512-bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "plain"


def test_the_host_build_takes_the_instruction_set_the_cpu_flags_name():
    assert row_linear.kernel() is not None
    assert build("host").row_linear_isa() == expected_isa()
    assert build("no-avx512").row_linear_isa() == ("avx2" if {"avx2", "fma"} <= cpu_flags() else "plain")
    assert build("plain").row_linear_isa() == "plain"


def assert_like_torch(out, x, weight):
    if weight.dtype is torch.float32:
        torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=2e-5)
    else:  # both sum in fp32 and round once to bf16: at most an ulp or so apart
        torch.testing.assert_close(out, F.linear(x, weight), rtol=1.6e-2, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_agrees_with_f_linear_at_every_row_count(shape, dtype):
    weight, x = weight_and_rows(shape, dtype, max(ROWS))
    row = RowWeight(weight)
    for rows in ROWS:
        out = row.linear(x[:rows])
        assert out.shape == (rows, shape[0]) and out.dtype == dtype
        assert_like_torch(out, x[:rows], weight)


@pytest.mark.parametrize("name", ["no-avx512", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_builds_for_other_cpus_agree_with_f_linear(name, dtype):
    for shape in [(960, 576), (576, 1536), (37, 101)]:
        weight, x = weight_and_rows(shape, dtype, 33)
        row = RowWeight(weight, build(name))
        for rows in (1, 7, 33):
            assert_like_torch(row.linear(x[:rows]), x[:rows], weight)


def assert_row_invariant(row: RowWeight, shape, dtype, counts, seed=1):
    """A probe row alone, then at the start, middle and end of calls of `counts` rows of random
    neighbours, and in every place of a call made of its copies: the same bits each time."""
    generator = torch.Generator().manual_seed(seed)
    probe = torch.randn(1, shape[1], generator=generator).to(dtype)
    alone = row.linear(probe)[0]
    for count in counts:
        batch = torch.randn(count, shape[1], generator=generator).to(dtype)
        places = sorted({0, count // 2, count - 1})
        batch[places] = probe
        out = row.linear(batch)
        for place in places:
            assert torch.equal(out[place], alone), f"{count} rows, place {place}"
    copies = row.linear(probe.expand(37, -1).contiguous())
    assert torch.equal(copies, alone.expand(37, -1))


INVARIANCE_COUNTS = (2, 3, 5, 6, 7, 13, 16, 33, 64, 200, 2048)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (37, 101)], ids=str)
def test_a_row_has_the_same_bits_alone_and_inside_calls_of_up_to_2048_rows(shape, dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_row_invariant(RowWeight(torch.randn(shape).mul(0.05).to(dtype)), shape, dtype, INVARIANCE_COUNTS)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_output_head_keeps_a_row_bitwise_inside_a_batch(dtype):
    shape = (49152, 576)
    assert_row_invariant(RowWeight(torch.randn(shape).mul(0.05).to(dtype)), shape, dtype, (2, 7, 64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_thread_count_never_changes_a_bit(dtype):
    weight, x = weight_and_rows((960, 576), dtype, 65)
    row, before = RowWeight(weight), torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(row.linear(x))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(out, outs[0]) for out in outs)


@pytest.mark.parametrize("name", ["no-avx512", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_builds_for_other_cpus_keep_a_row_bitwise_inside_a_batch(name, dtype):
    shape = (960, 576)
    row = RowWeight(torch.randn(shape).mul(0.05).to(dtype), build(name))
    assert_row_invariant(row, shape, dtype, (2, 5, 7, 33, 200))


def test_leading_dimensions_and_a_bias_are_kept():
    weight, x = weight_and_rows((37, 101), torch.float32, 6)
    bias = torch.randn(37)
    out = RowWeight(weight).linear(x.view(2, 3, 101), bias)
    torch.testing.assert_close(out, F.linear(x.view(2, 3, 101), weight, bias), rtol=1e-5, atol=1e-5)


def test_the_packed_weight_is_read_as_panels_of_sixteen_columns():
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    packed = row_linear.pack(weight)
    assert packed.shape == (2, 3, 16)
    assert torch.equal(packed[0, :, 5], weight[5]) and torch.equal(packed[1, :, 3], weight[19])
    assert not packed[1, :, 4:].any()  # columns past the matrix are zeros
    pairs = row_linear.pack(weight.to(torch.bfloat16))
    assert pairs.shape == (2, 2, 16, 2)  # K = 3 rounded up to a pair
    assert torch.equal(pairs[0, 1, 5], torch.tensor([5 * 3 + 2, 0], dtype=torch.bfloat16))


# Weight-only int8: the same chains over k on the int8 values, then each column's scale.


def assert_like_dequantised(row: RowWeight, x):
    n, k = row.shape  # the int8 values times their fp32 scales, exactly (matrix() rounds them to the dtype)
    scales = row.packed[:, k:].contiguous().view(torch.float32).reshape(-1)[:n]
    values = row.packed[:, :k].transpose(1, 2).reshape(-1, k)[:n].float() * scales[:, None]
    expected = x.float() @ values.t()
    if x.dtype is torch.float32:
        torch.testing.assert_close(row.linear(x), expected, rtol=1e-5, atol=2e-5)
    else:
        torch.testing.assert_close(row.linear(x).float(), expected, rtol=1.6e-2, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (37, 101)], ids=str)
def test_int8_panels_agree_with_their_dequantised_matrix_at_every_row_count(shape, dtype):
    from engine.kernels.quant import Int8Weight

    weight, x = weight_and_rows(shape, dtype, max(ROWS))
    row = RowWeight(weight, int8=True)
    reference = Int8Weight(weight)  # torch's int8 path quantises to the same values
    assert torch.equal(row.packed[:, : shape[1]].transpose(1, 2).reshape(-1, shape[1])[: shape[0]], reference.qweight)
    torch.testing.assert_close(row.matrix().float(), weight.float(), rtol=0, atol=weight.float().abs().max().item() / 200)
    for rows in ROWS:
        assert_like_dequantised(row, x[:rows])


@pytest.mark.parametrize("name", ["host", "no-avx512", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_panels_keep_a_row_bitwise_inside_calls_of_up_to_2048_rows(name, dtype):
    shape = (960, 576)
    row = RowWeight(torch.randn(shape).mul(0.05).to(dtype), build(name), int8=True)
    assert_like_dequantised(row, torch.randn(7, shape[1]).to(dtype))
    counts = INVARIANCE_COUNTS if name == "host" else (2, 5, 7, 33, 200)
    assert_row_invariant(row, shape, dtype, counts)


def test_kev_row_linear_0_declines_the_kernel(monkeypatch):
    monkeypatch.setenv("KEV_ROW_LINEAR", "0")
    assert row_linear.kernel() is None and not row_linear.usable(torch.zeros(4, 4))


# Deterministic mode on row_linear (engine/deterministic/rows.py).


def test_deterministic_mode_multiplies_fp32_and_bf16_models_through_row_linear(tiny_models, harness):
    from engine.deterministic import rows
    from engine.deterministic.mode import DETERMINISTIC

    tiny = tiny_models["llama3-rope-tied"]
    for dtype in DTYPES:
        weights = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, dtype=dtype).weights
        weights.use(DETERMINISTIC)
        for matrix in weights.matrices():
            row = rows.row_weight(matrix)
            assert row is not None and row.shape == matrix.shape and row.dtype == dtype
        x = torch.randn(5, weights.lm_head.shape[1]).to(dtype)  # the output head, tied to the embedding table
        assert torch.equal(weights.linear(x, weights.lm_head), RowWeight(weights.embed).linear(x))


def test_int8_weights_multiply_through_row_linears_int8_panels_in_deterministic_mode(tiny_models, harness):
    from engine.deterministic import rows
    from engine.deterministic.mode import DETERMINISTIC

    tiny = tiny_models["llama"]
    weights = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer).weights
    weights.quantize_int8()
    weights.use(DETERMINISTIC)
    assert all(rows.row_weight(matrix) is matrix and matrix.int8 for matrix in weights.matrices())


def test_a_shape_failing_the_check_takes_the_tiles_and_says_so(tiny_models, harness, monkeypatch, logs):
    from engine.deterministic import rows, tiles
    from engine.deterministic.mode import DETERMINISTIC

    monkeypatch.setattr(rows, "row_invariant", lambda row: False)
    monkeypatch.setattr(rows, "_COPIES", {})
    monkeypatch.setattr(rows, "_CHECKED", {})
    tiny = tiny_models["llama"]
    weights = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer).weights
    weights.use(DETERMINISTIC)
    x = torch.randn(3, weights.lm_head.shape[1])
    assert rows.row_weight(weights.lm_head) is None
    assert torch.equal(weights.linear(x, weights.lm_head), tiles.tiled_linear(x, weights.lm_head))
    declined = [entry for entry in logs if entry["event"] == "deterministic.row_linear_declined"]
    assert {tuple(entry["shape"]) for entry in declined} == {tuple(m.shape) for m in weights.matrices()}


def test_the_start_up_check_passes_here_and_catches_a_kernel_that_mixes_rows():
    from engine.deterministic import rows

    row = RowWeight(torch.randn(96, 64).to(torch.bfloat16))
    assert rows.row_invariant(row)

    class Mixing(RowWeight):  # a row's result nudged by how many rows share the call
        def linear(self, x, bias=None):
            return super().linear(x, bias) * (1 + (x.shape[0] > 1) * 2.0 ** -12)

    mixing = Mixing(torch.randn(96, 64))
    assert not rows.row_invariant(mixing)


def test_a_bf16_matrix_comes_back_from_its_onednn_copy():
    from engine.kernels.packed_weight import PackedWeight, can_pack

    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU cannot reorder bf16 weights for oneDNN (no packed copy to recover from)")
    weight = torch.randn(200, 101).to(torch.bfloat16)
    assert torch.equal(PackedWeight(weight).matrix(), weight)


def test_the_start_up_line_names_the_instruction_set_and_the_split(tiny_models, harness, logs):
    from engine.deterministic.mode import DETERMINISTIC

    tiny = tiny_models["qwen2"]
    weights = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer).weights
    weights.use(DETERMINISTIC)
    line = next(entry for entry in logs if entry["event"] == "deterministic.row_linear")
    assert line["isa"] == expected_isa() and line["tiled"] == 0
    assert line["matrices"] == len(weights.matrices()) and line["threads"] == torch.get_num_threads()


def test_a_new_thread_count_is_checked_before_the_kernel_is_trusted_there(tiny_models, harness, monkeypatch):
    from engine.deterministic import rows
    from engine.deterministic.mode import DETERMINISTIC

    tiny = tiny_models["llama"]
    weights = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer).weights
    weights.use(DETERMINISTIC)
    threads = torch.get_num_threads()
    assert rows.row_weight(weights.lm_head) is not None
    checked = []
    monkeypatch.setattr(rows, "row_invariant", lambda row: checked.append(tuple(row.shape)) or False)
    monkeypatch.setattr(rows, "_CHECKED", {})
    try:
        torch.set_num_threads(threads + 1)
        assert rows.row_weight(weights.lm_head) is None  # failed here: the tiles take this thread count
        assert checked == [tuple(weights.lm_head.shape)]
    finally:
        torch.set_num_threads(threads)
    assert rows.row_weight(weights.lm_head) is not None  # still proven at the first count


@pytest.mark.parametrize("width", [64, 576, 960])
def test_bf16_rms_norm_in_one_call_is_transformers_within_one_bf16_step_and_row_invariant(width):
    """engine.model.layers.rms_norm on the CPU goes through the extension's rms_norm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from engine.model.layers import rms_norm

    if row_linear.kernel() is None:
        pytest.skip("no C++ compiler: the kernel is not built")
    generator = torch.Generator().manual_seed(width)
    norm = LlamaRMSNorm(width, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.randn(width, generator=generator) * 0.3 + 1).to(torch.bfloat16)
    x = (torch.randn(300, width, generator=generator) * 3).to(torch.bfloat16)
    expected, ours = norm(x), rms_norm(x, norm.weight.data, 1e-5)
    step = expected.float().abs() * 2**-7  # one bf16 step at each value (8 significant bits)
    assert ((expected.float() - ours.float()).abs() <= 2 * step).all()
    assert (expected == ours).float().mean() > 0.999
    for row in (0, 7, 299):
        assert torch.equal(rms_norm(x[row : row + 1].contiguous(), norm.weight.data, 1e-5)[0], ours[row])


@pytest.mark.parametrize("width", [64, 576])
def test_fp32_rms_norm_in_one_call_is_transformers_within_rounding_and_row_invariant(width):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from engine.model.layers import rms_norm

    if row_linear.kernel() is None:
        pytest.skip("no C++ compiler: the kernel is not built")
    generator = torch.Generator().manual_seed(width)
    norm = LlamaRMSNorm(width, eps=1e-6)
    norm.weight.data = torch.randn(width, generator=generator) * 0.3 + 1
    x = torch.randn(300, width, generator=generator) * 3
    expected, ours = norm(x), rms_norm(x, norm.weight.data, 1e-6)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=4e-6)  # a few fp32 ulps: another sum order
    for row in (0, 150, 299):
        assert torch.equal(rms_norm(x[row : row + 1].contiguous(), norm.weight.data, 1e-6)[0], ours[row])
