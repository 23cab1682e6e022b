"""A model's whole layer stack in one C++ call per step (layer_stack.cpp), where every part of it runs there.

The Python forward makes about 18 torch calls per layer; at one decode row each costs more than its
arithmetic, so a step of one question spent a sixth of its time between the matmuls. The stack runs
the same layer as a C++ loop over the same compiled kernels, with no Python per layer.

It takes a step when the whole step fits it: every layer matrix multiplied by row_linear (core.matmul;
fp32, bf16 or int8 panels; in deterministic mode proven row-invariant), rows attending through the
paged kernel over an fp32 or bf16 cache (engine/kernels/rowwise.py), and no LoRA adapter in the step.
Whether a model's steps can take it is logged once per engine as `layer_stack`. Otherwise the Python forward
runs the step. Both give a row the same bits (tests/test_layer_stack.py), so the choice, which a
neighbour's adapter can change, never reaches an answer.
"""

from __future__ import annotations

import structlog
import torch

from engine.kernels import native
from engine.kernels.row_linear import RowWeight
from engine.kernels.rowwise import RowwiseStep

log = structlog.get_logger("kev.engine.layer_stack")


class LayerStack:
    """A Transformer's layer weights as layer_stack.cpp reads them, and the call that runs them."""

    def __init__(self, model, module):
        self.op = module.layer_stack
        spec = model.spec
        empty = torch.empty(0, dtype=model.cos.dtype)
        self.weights = [weight for layer in model.layers for weight in (
            layer.input_norm, layer.qkv.packed, _or(layer.qkv_bias, empty), _or(layer.q_norm, empty),
            _or(layer.k_norm, empty), layer.o_proj.packed, layer.post_norm, layer.gate_up.packed, layer.down.packed)]
        self.cos, self.sin_signed = model.cos, model.sin_signed
        self.heads, self.kv_heads, self.eps = spec.num_heads, spec.num_kv_heads, spec.rms_norm_eps
        self.intermediate = model.layers[0].down.shape[1]
        self.scale = spec.head_dim ** -0.5  # as the paged kernel's Python caller computes it
        # Each layer's sliding window (Mistral, Phi-3; 0: every earlier key), as LayerKV.form gives it to Python.
        self.windows = [form.window or 0 for form in spec.attention] or [0] * spec.num_layers
        self.dtype = model.cos.dtype
        self._caches: tuple[object, list[torch.Tensor]] | None = None

    @classmethod
    def build(cls, model) -> "LayerStack | None":
        """The stack for `model` under its current mode, or None where part of a layer must run in Python;
        the verdict is logged as `layer_stack`."""
        reason = _why_not(model)
        log.info("layer_stack", enabled=reason is None, reason=reason or "every layer runs in one C++ call per step")
        return cls(model, native.module()) if reason is None else None

    def runs(self, attend) -> bool:
        """Whether this step's attention is the stack's: row-wise over an unquantised cache of the rows' dtype
        (fp32 rows: also fp16)."""
        return isinstance(attend, RowwiseStep) and attend.kv.reads_plain and attend.kv.compute_dtype == self.dtype

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, attend: RowwiseStep) -> torch.Tensor:
        rows = attend.rows
        return self.op(hidden.contiguous(), self.weights, self._layer_caches(attend.kv), positions.contiguous(),
                       self.cos, self.sin_signed, attend.slots, rows.table, rows.lengths, rows.block_size,
                       self.heads, self.kv_heads, self.intermediate, self.scale, self.eps, self.windows)

    def _layer_caches(self, kv) -> list[torch.Tensor]:
        """Each layer's keys then values, listed once per cache."""
        if self._caches is None or self._caches[0] is not kv:
            self._caches = (kv, [t for layer in kv.layers for t in (layer.k, layer.v)])
        return self._caches[1]


def _why_not(model) -> str | None:
    if native.module() is None:
        return "Kev's CPU kernels are not built here"
    if not model.llama_layers:
        return f"{model.spec.architecture}'s layers differ from Llama's (the stack runs only those)"
    if model.cos.device.type != "cpu" or model.cos.dtype not in (torch.float32, torch.bfloat16):
        return "the stack runs fp32 and bf16 models on the CPU"
    matrices = [getattr(layer, name) for layer in model.layers for name in ("qkv", "o_proj", "gate_up", "down")]
    if not all(isinstance(m, RowWeight) and m.dtype == model.cos.dtype and model.mode.row_weight(m) is m
               for m in matrices):
        return "the weights multiply through the library, or deterministic mode tiles some of them"
    if model.cos.dtype is torch.bfloat16 and any(m.shape[1] % 2 and not m.int8 for m in matrices):
        return "a bf16 matrix of odd width (row_linear pads it in Python)"
    return None


def _or(tensor: torch.Tensor | None, empty: torch.Tensor) -> torch.Tensor:
    return empty if tensor is None else tensor
