"""bf16 weights reordered once into oneDNN's layout multiply exactly as F.linear does at decode-sized row counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.packed_weight import PackedWeight, can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this torch has no oneDNN linear-weight reorder")


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


def test_a_bf16_model_on_cpu_multiplies_by_packed_weights_and_fp32_does_not(tiny_models):
    from conftest import kev_model_from_hf

    tiny = next(iter(tiny_models.values()))
    bf16 = kev_model_from_hf(tiny.hf, tiny.kev.tokenizer, dtype=torch.bfloat16).weights
    assert all(isinstance(m, PackedWeight) for m in bf16.matrices())
    assert isinstance(bf16.embed, torch.Tensor)  # lookups read the plain table
    assert all(isinstance(m, torch.Tensor) for m in tiny.kev.weights.matrices())
