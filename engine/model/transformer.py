"""Kev's own decoder forward (the Llama layer and its relatives) over a flat, packed batch of tokens.

There is no batch dimension: tokens of every scheduled question lie in one row list, each with its own
position. Only attention looks across tokens, and it does so through the attention backend, which
keeps each question to its own keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch
from safetensors.torch import load_file

from engine.deterministic.mode import FAST, MathMode
from engine.kernels import matmul
from engine.attention_form import AttentionForm
from engine.kernels.block_weight import BlockWeight
from engine.kernels.layer_stack import LayerStack
from engine.kernels.packed_weight import PackedWeight, can_pack
from engine.kernels.quant import Int8Weight
from engine.kernels.row_linear import RowWeight
from engine.model.layer_weights import MATRICES, WEIGHT_PREFIXES, LayerWeights, read_layer
from engine.model.layers import apply_rope, embed, gelu_tanh_mul, rms_norm, rotate, swiglu
from engine.model.rotary import RotaryTables

# Attend(layer_index, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LoraRows(Protocol):
    """One forward's adapters and their rows, as MathMode.lora_batch builds them (a LoraBatch, or a
    TiledLoraBatch in deterministic mode)."""

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += each adapter's delta on x[rows], for its own rows only."""


def _row_weight(matrix) -> RowWeight:
    """The matrix repacked for row_linear; one already its (a GGUF's BlockWeight) as it is."""
    return matrix if isinstance(matrix, RowWeight) else RowWeight(matrix)


def _unpacked(matrix):
    """The plain matrix of a weight (an fp32 packed weight keeps one); quantising starts from it."""
    if isinstance(matrix, RowWeight):
        return matrix.matrix()
    if not isinstance(matrix, PackedWeight):
        return matrix
    if matrix.plain is None:
        raise ValueError("a bf16 matrix packed for oneDNN cannot be quantised; load the model with weights='int8'")
    return matrix.plain


class Transformer:
    def __init__(self, spec, embed: torch.Tensor, layers: list[LayerWeights], final_norm: torch.Tensor,
                 lm_head: torch.Tensor, rope: "RotaryTables | dict[str, tuple[torch.Tensor, torch.Tensor]]",
                 mode: MathMode = FAST):
        self.spec = spec
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        # Per rotary table, cos and the signed sine apply_rope takes; rows computed as positions reach them.
        self.rotary = rope if isinstance(rope, RotaryTables) else RotaryTables.whole(rope, spec.rope_interleaved)
        self.ropes = self.rotary.tables
        self.layer_rope = spec.layer_rope or ("all",) * spec.num_layers
        self.cos, self.sin_signed = self.ropes[self.layer_rope[0]]  # the layer stack's: one table for every layer
        # Gemma scales embeddings by sqrt(hidden), rounded to the weights' dtype as transformers does.
        self.embed_scale = torch.tensor(spec.hidden_size ** 0.5, dtype=embed.dtype) if spec.family == "gemma" else None
        self.matmul: matmul.MatmulChoice | None = None  # set by from_state_dict: which kernel multiplies
        self.mode, self.linear = mode, mode.linear  # from_state_dict checks the weights it ends with: use()
        self.stack: LayerStack | None = None
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim

    def use(self, mode: MathMode) -> None:
        """Compute with `mode`'s kernels (engine/deterministic/mode.py), once it has checked these weights."""
        mode.check(self.matrices())
        self.mode = mode
        self.linear = mode.linear
        self.stack = LayerStack.build(self)  # None where part of a layer must run in Python

    @property
    def llama_layers(self) -> bool:
        """Whether every layer is the Llama layer (what the C++ layer stack runs): silu MLP, full rotary by
        halves from one table, norms only before attention and MLP, attention scaled by 1/sqrt(head_dim)
        with no soft cap (a sliding window, as Mistral's, is the stack's too)."""
        spec = self.spec
        plain = AttentionForm.plain(spec.head_dim)
        return (spec.family == "llama" and spec.activation == "silu" and spec.rotary_dim in (0, spec.head_dim)
                and not spec.rope_interleaved and len(self.ropes) == 1
                and all(form.scale == plain.scale and form.softcap is None for form in spec.attention))

    @property
    def matmul_kernel(self) -> str:
        """row_linear or library: what multiplies this model's weights (core.matmul's verdict)."""
        return self.matmul.kernel if self.matmul is not None else "library"

    def matrices(self) -> list:
        """Every weight matrix a forward multiplies by (tensors, or Int8Weight when quantised)."""
        per_layer = [getattr(layer, name) for layer in self.layers for name in MATRICES]
        return per_layer + [self.lm_head]

    @property
    def nbytes(self) -> int:
        """Bytes of weights held (the tied embedding/output matrix once)."""
        seen, total = set(), 0
        tensors = [self.embed, self.final_norm, self.lm_head] + [
            t for layer in self.layers for t in vars(layer).values() if t is not None]
        # An fp32 packed weight holds its plain matrix too, which may be the tied embedding table.
        tensors = [part for t in tensors for part in ((t.packed, t.plain) if isinstance(t, PackedWeight) else (t,))
                   if part is not None]
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.nbytes
        return total

    def quantize_int8(self) -> None:
        """Weight-only int8 for every matmul and the embedding table (the biggest matrix: tied to the
        output head in small models). Norms, biases and rotary tables stay in the compute dtype. Where
        row_linear multiplies (core.matmul), the matrices become its int8 panels (row-invariant, and the
        output head gets its own copy beside the table's lookups); elsewhere torch's int8 kernel."""
        tied = self.spec.tie_embeddings or _unpacked(self.lm_head) is self.embed
        rows = self.matmul_kernel == "row_linear"
        quantize = (lambda m: RowWeight(_unpacked(m), int8=True)) if rows else (lambda m: Int8Weight(_unpacked(m)))
        for layer in self.layers:
            for name in MATRICES:
                setattr(layer, name, quantize(getattr(layer, name)))
        head = _unpacked(self.lm_head)
        self.embed = Int8Weight(self.embed)
        self.lm_head = RowWeight(head, int8=True) if rows else self.embed if tied else Int8Weight(head)

    def pack_weights(self) -> None:
        """On CPU, every matmul's weight reordered once into oneDNN's layout (engine/kernels/packed_weight.py).
        A tied embedding table stays as it is for lookups; the output head gets its own packed copy."""
        for layer in self.layers:
            for name in MATRICES:
                setattr(layer, name, PackedWeight(getattr(layer, name)))
        self.lm_head = PackedWeight(self.lm_head)

    def repack_rows(self) -> None:
        """Every matmul's weight repacked once for row_linear (engine/kernels/row_linear.py), in place of
        the plain matrix. A tied embedding table stays as it is for lookups; the head gets its own copy."""
        for layer in self.layers:
            for name in MATRICES:
                setattr(layer, name, _row_weight(getattr(layer, name)))
        self.lm_head = _row_weight(self.lm_head)

    @classmethod
    def from_safetensors(cls, spec, path: Path, rope, device, dtype, mode: MathMode = FAST,
                         int8: bool = False, pack_fp32: bool = True, matmul_kernel: str = "auto") -> "Transformer":
        raw: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            raw.update(load_file(str(file)))
        if not raw:
            raise FileNotFoundError(f"{path} holds no *.safetensors weights")
        return cls.from_state_dict(spec, raw, rope, device, dtype, mode, int8, pack_fp32, matmul_kernel)

    @classmethod
    def from_state_dict(cls, spec, raw: dict[str, torch.Tensor], rope, device, dtype,
                        mode: MathMode = FAST, int8: bool = False, pack_fp32: bool = True,
                        matmul_kernel: str = "auto") -> "Transformer":
        """`matmul_kernel`: core.matmul (auto | row_linear | library), see engine/kernels/matmul.py;
        `pack_fp32`: whether the library's fp32 matrices also get a oneDNN-packed copy."""
        def get(name: str) -> torch.Tensor:
            if name not in raw:
                raise KeyError(f"weight {name!r} is missing from the checkpoint")
            value = raw[name]
            if isinstance(value, BlockWeight):  # a GGUF's matrix in its blocks: multiplied as stored
                return value
            return value.to(device=device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor:
            """A norm's weight as Kev multiplies by it: Gemma stores w and scales by (1 + w), added in fp32."""
            if spec.family != "gemma":
                return get(name)
            return (1.0 + get(name).float()).to(dtype)

        # A multimodal checkpoint holds its language model under another prefix (its images are not read).
        decoder = next((p for p in WEIGHT_PREFIXES if p + "embed_tokens.weight" in raw), "model.")
        layers = [read_layer(spec, get, norm, raw.__contains__, f"{decoder}layers.{i}.") for i in range(spec.num_layers)]
        embed = get(decoder + "embed_tokens.weight")
        lm_head = embed if spec.tie_embeddings or "lm_head.weight" not in raw else get("lm_head.weight")
        if isinstance(rope, tuple):  # one table for every layer (cos, sin)
            rope = {"all": rope}
        if not isinstance(rope, RotaryTables):  # whole tables (tests): in the model's dtype, on its device
            rope = {key: tuple(t.to(device=device, dtype=dtype) for t in pair) for key, pair in rope.items()}
        model = cls(spec, embed, layers, norm(decoder + "norm.weight"), lm_head, rope)
        probes = [layers[0].gate_up, layers[0].down]
        if isinstance(probes[0], BlockWeight):  # a GGUF's blocks: block_linear, row_linear's counterpart
            model.matmul = matmul.stored_blocks(probes[0].isa)
        else:
            model.matmul = matmul.choose(matmul_kernel, dtype, torch.device(device), probes, quantized=int8)
        if int8:
            model.quantize_int8()
        elif model.matmul.kernel == "row_linear":
            model.repack_rows()
        elif can_pack(dtype, device) and (pack_fp32 or dtype != torch.float32):
            model.pack_weights()
        model.use(mode)  # after quantising: the mode's check sees the real kernels
        return model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
                lora: LoraRows | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for the flat tokens `input_ids` at their own `positions`.

        `lora`: each adapter's rows and weights for this forward; None (no adapter anywhere) costs nothing.
        """
        if positions.device.type == "cpu" and positions.numel():  # (engines reach their max_context at start)
            self.rotary.reach(int(positions.max()) + 1)
        hidden = embed(self.embed, input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if lora is None and self.stack is not None and self.stack.runs(attend):
            return self.stack.forward(hidden, positions, attend)  # the same bits, without Python per layer
        # Each table's cos and signed sine at every row's own position: [T, 1, rotary_dim].
        rows = {key: (cos[positions, None], sin[positions, None]) for key, (cos, sin) in self.ropes.items()}
        eps = self.spec.rms_norm_eps
        for index, layer in enumerate(self.layers):
            cos, sin_signed = rows[self.layer_rope[index]]
            out = self._attention(index, layer, hidden, cos, sin_signed, attend, lora)
            hidden = hidden + (out if layer.attn_out_norm is None else rms_norm(out, layer.attn_out_norm, eps))
            out = self._mlp(index, layer, hidden, lora)
            hidden = hidden + (out if layer.mlp_out_norm is None else rms_norm(out, layer.mlp_out_norm, eps))
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits only for the rows that draw a token; prompt rows never reach the output layer."""
        logits = self.linear(rms_norm(hidden, self.final_norm, self.spec.rms_norm_eps), self.lm_head)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _project(self, x, weight, lora: LoraRows | None, index: int, name: str, bias=None) -> torch.Tensor:
        out = self.linear(x, weight, bias)
        if lora is not None:
            lora.add(index, name, x, out)
        return out

    def _attention(self, index, layer: LayerWeights, hidden, cos, sin_signed, attend: Attend, lora) -> torch.Tensor:
        spec = self.spec
        x = rms_norm(hidden, layer.input_norm, spec.rms_norm_eps)
        qkv = self._project(x, layer.qkv, lora, index, "qkv", layer.qkv_bias)
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, spec.num_heads + spec.num_kv_heads, spec.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, spec.num_kv_heads, spec.head_dim)
        if layer.q_norm is not None:
            q, k = qk.split([spec.num_heads, spec.num_kv_heads], dim=1)
            qk = torch.cat([rms_norm(q, layer.q_norm, spec.rms_norm_eps), rms_norm(k, layer.k_norm, spec.rms_norm_eps)], 1)
        # q and k side by side: one rotary pass for both.
        q, k = rotate(qk, cos, sin_signed, spec.rope_interleaved).split([spec.num_heads, spec.num_kv_heads], dim=1)
        out = attend(index, q, k, v)
        return self._project(out.reshape(-1, self.q_size), layer.o_proj, lora, index, "o_proj")

    def _mlp(self, index, layer: LayerWeights, hidden, lora) -> torch.Tensor:
        x = rms_norm(hidden, layer.post_norm, self.spec.rms_norm_eps)
        gate_up = self._project(x, layer.gate_up, lora, index, "gate_up")
        gated = swiglu(gate_up) if self.spec.activation == "silu" else gelu_tanh_mul(gate_up)
        return self._project(gated, layer.down, lora, index, "down")
