"""The engine's speculative decoding, from its options: the drafter, and policy auto's cost tables."""

from __future__ import annotations

import time

import structlog

from engine.speculate.ngram import NgramDrafter
from engine.speculate.probe import measure, probe_rows, target_step

log = structlog.get_logger("kev.engine")


def build_drafter(options, model):
    """speculative.method's drafter; None when off."""
    if options.speculative == "off":
        return None
    log.info("speculative.on", method=options.speculative, max_draft_tokens=options.max_draft_tokens,
             ngram=[options.ngram_min, options.ngram_max], policy=options.speculative_policy)
    return NgramDrafter(options.max_draft_tokens, options.ngram_min, options.ngram_max)


def measure_costs(options, scheduler, runner, pool, device) -> None:
    """policy auto: time the runner (and a model drafter's own forward) against rows, once, before any
    question arrives; logged as `speculative.cost_model`."""
    if scheduler.drafter is None or options.speculative_policy != "auto":
        return
    started = time.perf_counter()
    rows = probe_rows(options.max_tokens_per_step)
    scheduler.step_costs = measure(target_step(runner, pool.num_blocks, pool.block_size), rows, device)
    figures = {"forward": scheduler.step_costs.summary()}
    drafter = scheduler.drafter
    if hasattr(drafter, "measure"):
        drafter.costs = drafter.measure(rows)
        figures["drafter"] = drafter.costs.summary()
    log.info("speculative.cost_model", **figures, seconds=round(time.perf_counter() - started, 3))
