"""The engine's speculative decoding, from its options: the Speculation the scheduler calls, its drafter, and
policy auto's cost tables."""

from __future__ import annotations

import time

import structlog
import torch

from engine.kv.cache import cache_dtype
from engine.speculate.draft_model import DraftModel, DraftModelRefused, check_tokenizer, layer_view
from engine.speculate.ngram import NgramDrafter
from engine.speculate.probe import BUDGET_S, measure, probe_rows, target_step
from engine.speculate.speculation import Speculation

log = structlog.get_logger("kev.engine")


def build_drafter(options, model, weights, capacity_tokens: int, block_size: int):
    """speculative.method's drafter; None when off. `weights`: the engine's own view of the target's
    weights (a layer-skipped draft shares its tensors); `capacity_tokens`: the target pool's tokens,
    which a draft model's own cache matches (it never holds more than the questions it drafts for)."""
    if options.speculative == "off":
        return None
    if options.speculative == "draft_model":
        drafter = _draft_model(options, model, weights, capacity_tokens, block_size)
        log.info("speculative.on", method=options.speculative, max_draft_tokens=options.max_draft_tokens,
                 draft_model=drafter.name, draft_kv_mib=round(drafter.nbytes / 2**20, 1),
                 policy=options.speculative_policy)
        return drafter
    log.info("speculative.on", method=options.speculative, max_draft_tokens=options.max_draft_tokens,
             ngram=[options.ngram_min, options.ngram_max], policy=options.speculative_policy)
    return NgramDrafter(options.max_draft_tokens, options.ngram_min, options.ngram_max)


def _draft_model(options, model, weights, capacity_tokens: int, block_size: int) -> DraftModel:
    """speculative.draft_model (loaded here, same tokenizer, same device and dtype), and/or
    speculative.draft_layers (the first N layers of the draft model, or of the target when no
    draft_model is named: no weights of its own)."""
    source, layers = options.draft_model, options.draft_layers
    if source is None and layers is None:
        raise DraftModelRefused("speculative.method draft_model needs speculative.draft_model (a model Kev "
                                "loads, same tokenizer) or speculative.draft_layers (the target's first N layers)")
    name = f"{model.name}[:{layers} layers]"
    spec = model.spec
    if source is not None:
        from engine.model.model import load_model  # reads files: only when a draft model is asked for

        draft = load_model(source, device=str(model.device), dtype=model.dtype, deterministic=options.deterministic)
        draft.weights.rotary.reach(options.max_context)
        check_tokenizer(model, draft, str(source))
        weights, spec, name = draft.weights, draft.spec, draft.name if layers is None else f"{draft.name}[:{layers} layers]"
    if layers is not None:
        weights, spec = layer_view(weights, spec, layers)
    # The draft's cache keeps the target's fp16 storage (kv_cache.dtype fp16, or auto on a GGUF kept as stored);
    # int8 needs key centres the draft has no use for: it caches in the compute dtype then, as otherwise.
    kv = torch.float16 if cache_dtype(options.kv_dtype, model) == torch.float16 else model.dtype
    return DraftModel(weights, spec, model.device, model.dtype, options.max_draft_tokens, capacity_tokens,
                      block_size, name, kv_dtype=kv)


def build_speculation(options, model, weights, runner, pool) -> Speculation | None:
    """speculative.method as the scheduler calls it; None when off. Policy auto's cost tables are measured
    here, before any question holds a block (engine/speculate/probe.py)."""
    drafter = build_drafter(options, model, weights, pool.num_blocks * pool.block_size, pool.block_size)
    if drafter is None:
        return None
    speculation = Speculation(drafter, options.speculative_policy)
    if options.speculative_policy == "auto":
        _measure_costs(options, speculation, runner, pool, model.device)
    return speculation


def _measure_costs(options, speculation: Speculation, runner, pool, device) -> None:
    """policy auto: time the runner (and a model drafter's own forward) against rows, once; logged as
    `speculative.cost_model`."""
    started = time.perf_counter()
    rows = probe_rows(options.max_tokens_per_step)
    speculation.costs = measure(target_step(runner, pool.num_blocks, pool.block_size), rows, device)
    figures = {"forward": speculation.costs.summary()}
    drafter = speculation.drafter
    if hasattr(drafter, "measure"):  # within the same budget, roughly: half of it again
        drafter.costs = drafter.measure(rows, BUDGET_S / 2)
        figures["drafter"] = drafter.costs.summary()
    log.info("speculative.cost_model", **figures, seconds=round(time.perf_counter() - started, 3))
