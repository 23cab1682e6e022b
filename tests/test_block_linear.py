"""block_linear: GGUF block-format weights multiplied as stored (engine/kernels/block_weight.py).

Blocks are random bytes with sane fp16 scales, so every code and scale pattern occurs; gguf-py's own
dequantisation gives the weights they stand for. Checked: the kernel against a reference that quantizes
the rows the same way (near exact) and against dequantize-then-matmul (within the rounding of the rows'
int8 codes, a bound computed per output); a row alone == inside 2-2048 rows, at 1, 2 and 3 threads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine.kernels import native, row_linear
from engine.kernels.block_weight import FORMATS, BlockTensor, BlockWeight, pack
from engine.kernels.cpu_features import int8_dot_isa

SCALE_FIELDS = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# (outputs, inputs): the tiny test model's and SmolLM2's layer shapes, and Qwen2.5-0.5B's widths
SHAPES_32 = [(64, 64), (128, 64), (64, 128), (96, 576), (64, 896)]
SHAPES_256 = [(64, 256), (48, 1536), (32, 4864)]


def random_blocks(name: str, rows: int, k: int, seed: int = 0) -> BlockTensor:
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, k // fmt.block, fmt.bytes), dtype=np.uint8)
    for start in SCALE_FIELDS[name]:  # scales of a trained model's size; random bits could be inf or NaN
        scales = rng.uniform(1e-3, 2e-2, size=data.shape[:2]).astype(np.float16)
        data[:, :, start:start + 2] = scales.view(np.uint8).reshape(*data.shape[:2], 2)
    return BlockTensor(fmt, torch.from_numpy(data.reshape(rows, -1)), k)


def dequantized(blocks: BlockTensor) -> np.ndarray:
    qtype = GGMLQuantizationType[blocks.format.name]
    return quants.dequantize(blocks.data.numpy(), qtype).astype(np.float32)


def row_codes(x: np.ndarray):
    """Each row's int8 codes and per-32 scales, as the kernel makes them (float32 throughout)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127)
    return q, d


def reference(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The rows' codes times their scales against the exact weights, in float64."""
    q, d = row_codes(x)
    w = weights.astype(np.float64).reshape(weights.shape[0], -1, 32)
    return np.einsum("mbi,nbi,mb->mn", q.astype(np.float64), w, d.astype(np.float64))


def kernel():
    module = native.module()
    assert module is not None, "Kev's CPU kernels must build here"
    return module


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantized_rows_match_gguf(name):
    k = 256 if FORMATS[name].block == 256 else 96
    blocks = random_blocks(name, 24, k)
    weight = BlockWeight([blocks], torch.float32, kernel())
    assert np.array_equal(weight.matrix().numpy(), dequantized(blocks))


@pytest.mark.parametrize("name", list(FORMATS))
def test_matches_references(name):
    shapes = SHAPES_256 if FORMATS[name].block == 256 else SHAPES_32
    generator = torch.Generator().manual_seed(1)
    for n, k in shapes:
        blocks = random_blocks(name, n, k, seed=n + k)
        weight, exact = BlockWeight([blocks], torch.float32, kernel()), dequantized(blocks)
        for rows in (1, 7, 200):
            x = torch.randn(rows, k, generator=generator)
            out = weight.linear(x).numpy().astype(np.float64)
            same_codes = reference(x.numpy(), exact)
            magnitude = np.abs(x.numpy().astype(np.float64)) @ np.abs(exact.astype(np.float64)).T
            assert np.all(np.abs(out - same_codes) <= 1e-5 * magnitude + 1e-6), (name, n, k, rows)
            _, d = row_codes(x.numpy())  # a row's code is off by at most half its block's scale
            bound = np.einsum("mb,nb->mn", d.astype(np.float64) / 2,
                              np.abs(exact.astype(np.float64)).reshape(n, -1, 32).sum(-1))
            plain = x.numpy().astype(np.float64) @ exact.astype(np.float64).T
            assert np.all(np.abs(out - plain) <= bound * 1.001 + 1e-5 * magnitude), (name, n, k, rows)


def test_fused_parts_of_several_formats():
    parts = [random_blocks("Q5_0", 32, 256, 1), random_blocks("Q4_K", 16, 256, 2), random_blocks("Q6_K", 8, 256, 3),
             random_blocks("Q8_0", 8, 256, 4)]
    fused = BlockWeight(parts, torch.float32, kernel())
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([BlockWeight([part], torch.float32, kernel()).linear(x) for part in parts], 1)
    assert fused.shape == (64, 256) and torch.equal(fused.linear(x), alone)
    assert torch.equal(fused.rows(torch.tensor([40, 3])), fused.matrix()[[40, 3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_alone_equals_row_in_any_batch(dtype):
    generator = torch.Generator().manual_seed(3)
    # 42 outputs: tasks of 16, 16 and 10, so four-output pairs and the one-output path share a chunk
    weights = [BlockWeight([random_blocks(name, 42, 512, seed=i)], dtype, kernel()) for i, name in enumerate(FORMATS)]
    probe = torch.randn(1, 512, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for weight in weights:
                alone = weight.linear(probe)[0]
                for rows in (2, 3, 5, 13, 64, 65, 300, 2048):  # few_dots to 2-4 rows by format here, woven beyond
                    batch = torch.randn(rows, 512, generator=generator).to(dtype)
                    places = sorted({0, rows // 2, rows - 1})
                    batch[places] = probe
                    out = weight.linear(batch)
                    assert all(torch.equal(out[p], alone) for p in places), (weight.formats, rows, count)
    finally:
        torch.set_num_threads(threads)


def test_build_uses_the_cpu_flags_dot_product():
    assert kernel().block_linear_isa() == int8_dot_isa()


@pytest.mark.parametrize("flags", [row_linear.NO_AVX512, row_linear.PLAIN])
def test_other_builds_give_the_same_bits(flags):
    """AVX2 and plain builds compute the same integers and the same float operations as this one."""
    other = row_linear.compiled(flags)
    assert other is not None
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(5))
    for i, name in enumerate(FORMATS):
        blocks = random_blocks(name, 26, 512, seed=i)
        mine = BlockWeight([blocks], torch.float32, kernel())
        theirs = BlockWeight([blocks], torch.float32, other)
        for rows in (5, 40):  # below and above the rows where AVX-512 pairs four outputs (6)
            assert torch.equal(mine.linear(x[:rows]), theirs.linear(x[:rows])), (name, theirs.isa, rows)
        assert torch.equal(mine.linear(x[:1]), theirs.linear(x[:1])), (name, theirs.isa)  # a lone row's own path


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="whole 256-blocks"):
        BlockTensor(FORMATS["Q4_K"], torch.zeros(2, 144, dtype=torch.uint8), 200)
    with pytest.raises(ValueError, match="share their input width"):
        pack([random_blocks("Q8_0", 4, 64), random_blocks("Q8_0", 4, 96)])
    weight = BlockWeight([random_blocks("Q8_0", 4, 64)], torch.float32, kernel())
    with pytest.raises(RuntimeError, match=r"x \[M, 64\]"):
        weight.linear(torch.zeros(1, 32))
