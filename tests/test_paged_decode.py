"""The CPU decode kernel (engine/kernels/paged_decode.py) reads each question's keys where they lie in the pool.

It must give SDPA's answer, the same bits alone or packed, and never read a slot the question has not
written: a neighbour's slots (and a block's unwritten tail) are filled with NaN here. Caches: fp32, bf16,
fp16 (with fp32 queries: widened exactly, so the bits of an fp32 cache holding the same values), and
int8 (with fp32 or bf16 queries), which the kernel reads as stored, scales applied per position. A step with few
rows gives each KV head its own task, one with many rows (4 per thread) gives each question one task:
the tests run both.
"""

from types import SimpleNamespace

import pytest
import torch

from engine.kernels import paged_decode
from engine.kernels.attention import Segment, TorchAttention, _DecodeGroups
from engine.attention_form import AttentionForm
from engine.kv.cache import KVCache

pytestmark = pytest.mark.skipif(paged_decode.kernel() is None, reason="no C++ compiler for the CPU decode kernel")

BLOCK = 16
SPEC = SimpleNamespace(num_layers=1, num_kv_heads=3, head_dim=64, num_heads=9)


def _many(lengths: list[int]) -> list[int]:
    """`lengths` repeated past 4 rows per thread: each question is then one task (all its KV heads)."""
    rows = 4 * torch.get_num_threads() + 1
    return (lengths * rows)[:max(rows, len(lengths))]


# cache -> (storage dtype, query dtype, tolerance against SDPA)
CACHES = {"fp32": (torch.float32, torch.float32, 1e-5), "bf16": (torch.bfloat16, torch.bfloat16, 2e-2),
          "fp16": (torch.float16, torch.float32, 1e-5),
          "int8": (torch.int8, torch.float32, 1e-5), "int8-bf16": (torch.int8, torch.bfloat16, 2e-2)}


def _setup(cache, lengths, seed=0, spec=SPEC):
    gen = torch.Generator().manual_seed(seed)
    blocks = sum(-(-length // BLOCK) for length in lengths) + 8
    storage, dtype, _ = CACHES[cache]
    kv = KVCache(spec, blocks, BLOCK, storage, torch.device("cpu"), dtype)
    keys, values = (torch.randn(kv.k.shape, generator=gen) for _ in range(2))
    if kv.quantized:  # through the cache's own write: int8 rows and their scales
        kv.layers[0].write(torch.arange(kv.k.shape[1]), keys[0], values[0])
    else:
        kv.k.copy_(keys)
        kv.v.copy_(values)
    free = torch.randperm(blocks, generator=gen).tolist()
    segments = []
    for row, length in enumerate(lengths):
        blocks = tuple(free.pop() for _ in range(-(-length // BLOCK)))
        segments.append(Segment(row, 1, length, blocks, generated=True))
    q = torch.randn(len(lengths), spec.num_heads, spec.head_dim, generator=gen).to(dtype)
    return kv, segments, q


@pytest.mark.parametrize("many", [False, True], ids=["task per head", "task per question"])
@pytest.mark.parametrize("cache", CACHES)
def test_paged_decode_gives_sdpa_s_answer_over_mixed_lengths(cache, many):
    lengths = [1, 7, 16, 17, 130, 300, 45]
    kv, segments, q = _setup(cache, _many(lengths) if many else lengths[:3])
    tolerance = CACHES[cache][2]
    layer = kv.layers[0]
    paged = paged_decode.PagedDecodes(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    sdpa = _DecodeGroups(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    torch.testing.assert_close(paged.float(), sdpa.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("head_dim, group", [(16, 1), (32, 2), (128, 4), (128, 8), (64, 7), (128, 5), (128, 6)])
@pytest.mark.parametrize("cache", ["fp32", "bf16", "fp16", "int8"])
def test_other_head_sizes_and_groups_give_sdpa_s_answer(cache, head_dim, group):
    """Every head size and query heads per KV head the kernel takes (the tests above: 64 and 3)."""
    spec = SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=head_dim, num_heads=2 * group)
    kv, segments, q = _setup(cache, _many([1, 16, 17, 130, 45]), spec=spec)
    tolerance = CACHES[cache][2]
    layer = kv.layers[0]
    paged = paged_decode.PagedDecodes(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    sdpa = _DecodeGroups(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    torch.testing.assert_close(paged.float(), sdpa.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("cache", CACHES)
def test_a_row_is_the_same_bits_alone_or_packed(cache):
    # Alone, a row's KV heads are separate tasks; packed with many rows, its question is one task.
    kv, segments, q = _setup(cache, _many([5, 33, 200, 64, 129, 16, 1]))
    layer = kv.layers[0]
    packed = paged_decode.PagedDecodes(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    for row, seg in enumerate(segments):
        alone = paged_decode.PagedDecodes([Segment(0, 1, seg.kv_len, seg.block_ids, True)], BLOCK,
                                          torch.device("cpu")).attend(q[row:row + 1], layer)
        assert torch.equal(alone[0], packed[row])


@pytest.mark.parametrize("many", [False, True], ids=["task per head", "task per question"])
@pytest.mark.parametrize("cache", ["fp32", "fp16", "int8"])
def test_a_question_never_reads_a_slot_it_has_not_written(cache, many):
    kv, segments, q = _setup(cache, _many([3, 40, 100, 32]) if many else [3, 40, 100])
    layer = kv.layers[0]
    before = paged_decode.PagedDecodes(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    owned = torch.zeros(kv.k.shape[1], dtype=torch.bool)
    for seg in segments:
        for pos in range(seg.kv_len):
            owned[seg.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK] = True
    # Every other question's slots, and each block's unwritten tail (an int8 cache: their scales).
    for rows in (kv.k_scale, kv.v_scale) if kv.quantized else (kv.k, kv.v):
        rows[0][~owned] = float("nan")
    after = paged_decode.PagedDecodes(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    assert torch.equal(before, after)


@pytest.mark.parametrize("cache", CACHES)
def test_cpu_decodes_take_the_kernel(cache):
    kv, segments, _ = _setup(cache, [10, 20])
    assert isinstance(TorchAttention(kv).prepare(segments).decode, paged_decode.PagedDecodes)


@pytest.mark.parametrize("cache", CACHES)
def test_the_path_for_cpus_without_avx512_agrees_and_keeps_rows_apart(cache):
    # Built here without AVX-512 (the 16-keys-at-once fold is AVX-512 only): what an AVX2 machine runs.
    portable = paged_decode.compiled((*paged_decode._CFLAGS, "-mno-avx512f"))
    assert portable is not None
    kv, segments, q = _setup(cache, _many([1, 16, 17, 130, 300, 45]))
    layer, cpu, tolerance = kv.layers[0], torch.device("cpu"), CACHES[cache][2]
    scales = (layer.k_scale, layer.v_scale) if kv.quantized else (None, None)

    def attend(op, segs, queries):
        step = paged_decode.PagedDecodes(segs, BLOCK, cpu)
        return op(queries.contiguous(), layer.k, layer.v, step.table, step.lengths, BLOCK, SPEC.head_dim ** -0.5,
                  0, 0.0, *scales)

    packed = attend(portable, segments, q)
    torch.testing.assert_close(packed.float(), attend(paged_decode.kernel(), segments, q).float(),
                               atol=tolerance, rtol=tolerance)
    for row, seg in enumerate(segments[:6]):
        alone = attend(portable, [Segment(0, 1, seg.kv_len, seg.block_ids, True)], q[row:row + 1])
        assert torch.equal(alone[0], packed[row])


@pytest.mark.parametrize("flags", ["native", "no-avx512", "plain"])
def test_an_fp16_cache_gives_the_bits_of_an_fp32_cache_holding_its_values(flags):
    """kv_cache.dtype fp16 changes what is stored (each value rounded once, when written), never how
    attention reads it: every build widens fp16 exactly, so the answer is the fp32 cache's to the bit."""
    from engine.kernels import native

    op = paged_decode.compiled({"native": native.CFLAGS, "no-avx512": native.NO_AVX512, "plain": native.PLAIN}[flags])
    kv, segments, q = _setup("fp16", _many([1, 16, 17, 130, 300, 45]))
    step = paged_decode.PagedDecodes(segments, BLOCK, torch.device("cpu"))

    def attend(k, v):
        return op(q.contiguous(), k, v, step.table, step.lengths, BLOCK, SPEC.head_dim ** -0.5, 0, 0.0, None, None)

    half = attend(kv.k[0], kv.v[0])
    assert torch.equal(half, attend(kv.k[0].float(), kv.v[0].float()))


FORMS = {"window": AttentionForm(0.1, window=20), "softcap": AttentionForm(0.2, softcap=1.5),
         "window-softcap": AttentionForm(64 ** -0.5, window=33, softcap=3.0)}


@pytest.mark.parametrize("many", [False, True], ids=["task per head", "task per question"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("cache", CACHES)
def test_a_layer_s_window_scale_and_soft_cap_give_the_reference_s_answer(cache, form, many):
    """Mistral's and Gemma's layers: the padded decode groups (masks and scores written out) as reference;
    each row alone gives the same bits."""
    lengths = [1, 7, 20, 21, 40, 130, 300]
    kv, segments, q = _setup(cache, _many(lengths) if many else lengths)
    layer = kv.layers[0]
    layer.form = FORMS[form]
    tolerance = CACHES[cache][2]
    paged = paged_decode.PagedDecodes(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    reference = _DecodeGroups(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    torch.testing.assert_close(paged.float(), reference.float(), atol=tolerance, rtol=tolerance)
    for row, seg in enumerate(segments[: len(lengths)]):
        alone = paged_decode.PagedDecodes([Segment(0, 1, seg.kv_len, seg.block_ids, True)], BLOCK,
                                          torch.device("cpu")).attend(q[row:row + 1], layer)
        assert torch.equal(alone[0], paged[row])


@pytest.mark.parametrize("cache", ["fp32", "int8"])
def test_blocks_before_a_window_are_never_read(cache):
    """A row at position 299 with a window of 20 reads only the blocks of positions 280..299: every
    earlier slot (and its int8 scale) is NaN here and changes no bit."""
    kv, segments, q = _setup(cache, [300, 45])
    layer = kv.layers[0]
    layer.form = AttentionForm(64 ** -0.5, window=20)
    before = paged_decode.PagedDecodes(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    for seg in segments:
        first_block = (seg.kv_len - 20) // BLOCK
        for block in seg.block_ids[:first_block]:
            for rows in (kv.k_scale, kv.v_scale, kv.k, kv.v) if kv.quantized else (kv.k, kv.v):
                rows[0][block * BLOCK:(block + 1) * BLOCK] = float("nan") if rows.is_floating_point() else 0
    after = paged_decode.PagedDecodes(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    assert torch.equal(before, after)


@pytest.mark.parametrize("cache", ["fp32", "bf16", "int8"])
def test_head_size_256_gives_sdpa_s_answer(cache):
    """Gemma's heads (256 wide; Gemma 3 270M: 4 query heads over 1 KV head)."""
    spec = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=256, num_heads=4)
    kv, segments, q = _setup(cache, [1, 16, 17, 130, 45], spec=spec)
    layer = kv.layers[0]
    paged = paged_decode.PagedDecodes(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    sdpa = _DecodeGroups(segments, BLOCK, torch.device("cpu")).attend(q, layer)
    tolerance = CACHES[cache][2]
    torch.testing.assert_close(paged.float(), sdpa.float(), atol=tolerance, rtol=tolerance)
