"""core.matmul: which kernel multiplies the weights on a CPU, chosen at load and logged."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import matmul, row_linear
from engine.kernels.quant import Int8Weight
from engine.kernels.row_linear import RowWeight

needs_kernel = pytest.mark.skipif(row_linear.kernel() is None, reason="no C++ compiler: row_linear is not built")


@needs_kernel
def test_auto_repacks_every_matrix_for_row_linear_and_holds_one_copy(tiny_models, logs):
    from conftest import kev_model_from_hf

    tiny = tiny_models["llama3-rope-tied"]
    rows = kev_model_from_hf(tiny.hf, tiny.kev.tokenizer).weights
    library = kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, matmul="library").weights
    assert rows.matmul.kernel == "row_linear" and rows.matmul.batch_invariant
    assert all(isinstance(m, RowWeight) for m in rows.matrices())
    assert isinstance(rows.embed, torch.Tensor)  # lookups read the plain table; the head has its own copy
    assert rows.nbytes < library.nbytes  # no plain or oneDNN copy beside the repacked one
    line = [e for e in logs if e["event"] == "matmul.kernel"][0]
    assert line["kernel"] == "row_linear" and line["batch_invariant"] is True and line["isa"]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_repacked_matrix_unpacks_to_the_loaded_one(dtype):
    weight = torch.randn(37, 101, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(RowWeight(weight).matrix(), weight)


@needs_kernel
def test_row_linear_models_answer_as_the_library_does(tiny_models, harness):
    """Same greedy tokens, logits within fp32 rounding, on every tiny architecture."""
    for kind, tiny in tiny_models.items():
        library = harness.kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, matmul="library")
        q = harness.Q("q", harness.random_prompt(random.Random(5), 40), dict(max_new_tokens=12))
        ours, theirs = harness.run_core(tiny.kev, [q]), harness.run_core(library, [q])
        assert ours.tokens("q") == theirs.tokens("q"), kind
        for a, b in zip(ours.logits["q"], theirs.logits["q"]):
            assert (a - b).abs().max().item() < 1e-4, kind


@needs_kernel
def test_a_row_linear_model_quantises_into_row_linears_int8_panels(tiny_models, harness):
    from conftest import kev_model_from_hf

    tiny = tiny_models["qwen2"]
    model = kev_model_from_hf(tiny.hf, tiny.kev.tokenizer)
    model.weights.quantize_int8()
    assert all(isinstance(m, RowWeight) and m.int8 for m in model.weights.matrices())
    assert isinstance(model.weights.embed, Int8Weight)  # lookups dequantise rows of the int8 table
    q = harness.Q("q", harness.random_prompt(random.Random(6), 30), dict(max_new_tokens=8))
    assert len(harness.run_core(model, [q]).tokens("q")) == 8
    library = kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, matmul="library")
    library.weights.quantize_int8()
    assert all(isinstance(m, Int8Weight) for m in library.weights.matrices())  # torch's int8 kernel


@needs_kernel
def test_int8_weights_on_row_linear_answer_as_torchs_int8_kernel_does(tiny_models, harness):
    """The same int8 values; row_linear keeps fp32 rows and scales where torch's kernel rounds them to bf16,
    so the logits stay close and the greedy tokens agree."""
    from conftest import kev_model_from_hf

    tiny = tiny_models["llama"]
    ours, theirs = (kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, matmul=kind) for kind in ("row_linear", "library"))
    for model in (ours, theirs):
        model.weights.quantize_int8()
    q = harness.Q("q", harness.random_prompt(random.Random(7), 40), dict(max_new_tokens=10))
    a, b = harness.run_core(ours, [q]), harness.run_core(theirs, [q])
    assert a.tokens("q") == b.tokens("q")
    assert max((x - y).abs().max().item() for x, y in zip(a.logits["q"], b.logits["q"])) < 0.05


def test_other_devices_take_the_library_and_say_why(logs):
    probes = [torch.randn(8, 8)]
    assert matmul.choose("auto", torch.float32, torch.device("meta"), probes).kernel == "library"
    with pytest.raises(ValueError, match="row_linear is a CPU kernel"):
        matmul.choose("row_linear", torch.bfloat16, torch.device("cuda"), probes)
    with pytest.raises(ValueError, match="not one of auto, row_linear, library"):
        matmul.choose("fastest", torch.float32, torch.device("cpu"), probes)
    reasons = [e["reason"] for e in logs if e["event"] == "matmul.kernel"]
    assert reasons == ["row_linear is a CPU kernel; the model is on meta"]


@needs_kernel
def test_int8_weights_take_row_linear_where_it_runs(logs):
    probes = [torch.randn(8, 8)]
    assert matmul.choose("auto", torch.float32, torch.device("cpu"), probes, quantized=True).kernel == "row_linear"
    assert matmul.choose("row_linear", torch.bfloat16, torch.device("cpu"), probes, quantized=True).kernel == "row_linear"


def test_without_the_kernel_auto_takes_the_library(monkeypatch, logs):
    monkeypatch.setenv("KEV_ROW_LINEAR", "0")
    choice = matmul.choose("auto", torch.float32, torch.device("cpu"), [torch.randn(8, 8)])
    assert choice.kernel == "library" and "KEV_ROW_LINEAR=0" in choice.reason and not choice.batch_invariant


@needs_kernel
def test_auto_times_both_kernels_on_matrices_of_a_real_size(logs):
    """SmolLM2's gate_up and down: both kernels timed at a decode's and a prompt's rows, the verdict logged
    with the figures (which kernel wins is the machine's business)."""
    generator = torch.Generator().manual_seed(2)
    probes = [torch.randn(3072, 576, generator=generator) * 0.05, torch.randn(576, 1536, generator=generator) * 0.05]
    choice = matmul.choose("auto", torch.float32, torch.device("cpu"), probes)
    if not matmul.can_pack(torch.float32, torch.device("cpu")):
        assert choice.reason.startswith("the library has no packed kernel")
        return
    assert set(choice.ms) == {f"{k}_{rows}_ms" for k in ("row_linear", "library") for rows in matmul.PROBE_ROWS}
    assert all(ms > 0 for ms in choice.ms.values())
    line = [e for e in logs if e["event"] == "matmul.kernel"][-1]
    assert line["kernel"] == choice.kernel and line["row_linear_256_ms"] == choice.ms["row_linear_256_ms"]
