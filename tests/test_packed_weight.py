"""Weights reordered once into oneDNN's layout: bf16 multiplies exactly as F.linear does at decode-sized row
counts; fp32 keeps its plain matrix for the row counts where MKL is faster and stays within rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.packed_weight import PackedWeight, can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.float32, torch.device("cpu")),
                                reason="this torch has no oneDNN linear-weight reorder")
BF16_PACKS = can_pack(torch.bfloat16, torch.device("cpu"))
needs_bf16_reorder = pytest.mark.skipif(not BF16_PACKS, reason="oneDNN reorders bf16 weights only with "
                                        "AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks")


@needs_bf16_reorder
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 32, 64, 300])
def test_packed_linear_is_bitwise_f_linear_at_every_row_count(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=generator).to(torch.bfloat16)
    bias = torch.randn(960, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
    packed = PackedWeight(weight)
    assert torch.equal(packed.linear(x), F.linear(x, weight))
    assert torch.equal(packed.linear(x, bias), F.linear(x, weight, bias))
    assert packed.shape == weight.shape and packed.dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 32, 96, 97, 300])
def test_fp32_packed_linear_agrees_with_f_linear_and_takes_the_plain_matrix_outside_its_rows(rows):
    from engine.kernels.packed_weight import PACKED_FP32_ROWS

    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=generator) * 0.05
    bias = torch.randn(960, generator=generator)
    x = torch.randn(rows, 576, generator=generator)
    packed = PackedWeight(weight)
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    if rows not in PACKED_FP32_ROWS:  # MKL's own product, bit for bit
        assert torch.equal(packed.linear(x, bias), F.linear(x, weight, bias))
    assert packed.plain is weight and packed.nbytes >= 2 * weight.nbytes


def test_models_on_the_library_multiply_by_packed_weights_and_count_a_tied_table_once(tiny_models):
    from conftest import kev_model_from_hf

    tiny = next(iter(tiny_models.values()))
    bf16 = kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, dtype=torch.bfloat16, matmul="library").weights
    if BF16_PACKS:
        assert all(isinstance(m, PackedWeight) and m.plain is None for m in bf16.matrices())
    else:  # the CPU cannot reorder bf16: plain matrices, F.linear
        assert all(isinstance(m, torch.Tensor) for m in bf16.matrices())
    assert isinstance(bf16.embed, torch.Tensor)  # lookups read the plain table
    tied = tiny_models["llama3-rope-tied"]
    fp32 = kev_model_from_hf(tied.hf, tied.kev.tokenizer, matmul="library").weights
    assert all(isinstance(m, PackedWeight) and m.plain is not None for m in fp32.matrices())
    assert fp32.lm_head.plain is fp32.embed  # tied: the table is also the output head's plain copy, counted once
    small = fp32.final_norm.nbytes + sum(t.nbytes for layer in fp32.layers for t in vars(layer).values()
                                         if isinstance(t, torch.Tensor))  # norms, biases
    assert fp32.nbytes == small + sum(m.nbytes for m in fp32.matrices())


def test_pack_fp32_off_keeps_one_plain_copy_and_the_same_products(tiny_models):
    from engine.model.model import rope_tables, spec_from_config
    from engine.model.transformer import Transformer

    tiny = tiny_models["llama"]
    spec = spec_from_config(tiny.hf.config)
    plain, packed = (Transformer.from_state_dict(spec, tiny.hf.state_dict(), rope_tables(tiny.hf.config, spec),
                                                 torch.device("cpu"), torch.float32, pack_fp32=pack, matmul_kernel="library")
                     for pack in (False, True))
    assert all(isinstance(m, torch.Tensor) for m in plain.matrices())
    assert plain.nbytes < packed.nbytes
    x = torch.randn(8, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(plain.linear(x, plain.layers[0].gate_up), packed.linear(x, packed.layers[0].gate_up),
                               rtol=1e-5, atol=1e-5)
