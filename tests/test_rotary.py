"""Rotary tables computed as far as positions reach (engine/model/rotary.py): rows computed late hold the bits
the whole table holds, an engine reaches its own max_context at start, and a forward past the computed rows
computes them first. Gemma 3 270M's two 32,768-position tables took 128 MiB resident when computed whole."""

from __future__ import annotations

import torch

from engine.model.model import rope_frequencies, rope_tables, rotary_tables, spec_from_config
from engine.model.layers import signed_sin
from engine.model.rotary import FIRST_REACH, RotaryTables

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
SHAPES = {"default": {}, "llama3 scaling": {"rope_scaling": LLAMA3}}


def test_rows_reached_in_steps_are_the_whole_tables_rows(harness):
    for name, extra in SHAPES.items():
        config = harness.build_hf_tiny("llama", max_position_embeddings=5000, **extra).config
        spec = spec_from_config(config)
        rotary = rotary_tables(config, spec, torch.float32, torch.device("cpu"))
        assert rotary.filled == FIRST_REACH
        for reach in (2049, 3001, 4096, 9999):  # past max_position: stops there
            rotary.reach(reach)
        assert rotary.filled == 5000
        for key, (cos, sin) in rope_tables(config, spec).items():
            assert torch.equal(rotary.tables[key][0], cos), name
            assert torch.equal(rotary.tables[key][1], signed_sin(sin, spec.rope_interleaved)), name


def _lazy(model) -> None:
    """`model`'s weights on tables of their own, computed to the first 8 positions only."""
    rotary = RotaryTables(rope_frequencies(model.hf_config, model.spec), model.spec.max_position,
                          model.spec.rope_interleaved, torch.float32, torch.device("cpu"))
    rotary.reach(8)
    model.weights.rotary, model.weights.ropes = rotary, rotary.tables
    model.weights.cos, model.weights.sin_signed = rotary.tables["all"]


def test_a_forward_past_the_computed_rows_computes_them_first(harness, smollm2_tokenizer):
    from test_gguf_blocks import model_logits

    hf = harness.build_hf_tiny("llama", seed=3)
    whole, lazy = (harness.kev_model_from_hf(hf, smollm2_tokenizer, dtype=torch.float32) for _ in range(2))
    _lazy(lazy)
    ids = torch.arange(1, 41)
    assert torch.equal(model_logits(lazy, ids), model_logits(whole, ids))
    assert lazy.weights.rotary.filled == 40


def test_an_engine_reaches_its_max_context_at_start(harness, smollm2_tokenizer):
    from engine import EngineCore

    model = harness.kev_model_from_hf(harness.build_hf_tiny("llama", seed=3), smollm2_tokenizer, dtype=torch.float32)
    _lazy(model)
    EngineCore(model, harness.tiny_options(max_context=300))
    assert model.weights.rotary.filled == 300
