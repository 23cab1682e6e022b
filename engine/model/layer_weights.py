"""A decoder layer's weights, as Kev multiplies by them, and how they are read from a checkpoint's tensors.

q, k and v are one fused matrix, and so are the MLP's gate and up, whether the checkpoint stores them
apart or together; where a checkpoint keeps its decoder depends on its kind (`WEIGHT_PREFIXES`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.packed_weight import PackedWeight
from engine.kernels.quant import Int8Weight
from engine.kernels.row_linear import RowWeight


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor | Int8Weight | PackedWeight | RowWeight  # q, k and v projections fused into one matmul
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up projections fused
    down: torch.Tensor
    attn_out_norm: torch.Tensor | None = None  # Gemma: normalises attention's output before the residual
    mlp_out_norm: torch.Tensor | None = None  # Gemma: normalises the MLP's output before the residual


MATRICES = ("qkv", "o_proj", "gate_up", "down")  # a layer's weight matrices
# Where a checkpoint keeps its decoder: a causal LM's model., Gemma 3's multimodal model.language_model.
# (language_model.model. as its files on the hub name it)
WEIGHT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def read_layer(spec, get, norm, stored, prefix: str) -> LayerWeights:
    """One layer's weights, q/k/v and gate/up fused whether the checkpoint stores them apart or (Phi-3,
    GLM) together; Gemma's four norms."""
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    fused_qkv = stored(attn + "qkv_proj.weight")
    qkv = get(attn + "qkv_proj.weight") if fused_qkv else torch.cat(
        [get(attn + "q_proj.weight"), get(attn + "k_proj.weight"), get(attn + "v_proj.weight")])
    bias = None
    if spec.qkv_bias:
        bias = get(attn + "qkv_proj.bias") if fused_qkv else torch.cat(
            [get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias")])
    gate_up = get(mlp + "gate_up_proj.weight") if stored(mlp + "gate_up_proj.weight") else torch.cat(
        [get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")])
    gemma = spec.family == "gemma"
    return LayerWeights(
        input_norm=norm(prefix + "input_layernorm.weight"),
        qkv=qkv,
        qkv_bias=bias,
        q_norm=norm(attn + "q_norm.weight") if spec.qk_norm else None,
        k_norm=norm(attn + "k_norm.weight") if spec.qk_norm else None,
        o_proj=get(attn + "o_proj.weight"),
        post_norm=norm(prefix + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")),
        gate_up=gate_up,
        down=get(mlp + "down_proj.weight"),
        attn_out_norm=norm(prefix + "post_attention_layernorm.weight") if gemma else None,
        mlp_out_norm=norm(prefix + "post_feedforward_layernorm.weight") if gemma else None,
    )
