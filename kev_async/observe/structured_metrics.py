"""The structured-answer counters (params.response_format), read from an engine's Constraints at scrape
time: how many questions were constrained, what compiling cost, and what the masks cost per step.

Mask time per step is `rate(kev_grammar_mask_seconds) / rate(kev_grammar_mask_steps)`; most of it runs
on the mask worker beside the forward, and `kev_grammar_mask_wait_seconds` is what the steps waited.
"""

from __future__ import annotations

STRUCTURED_COUNTERS = {
    "constrained": ("kev_constrained_questions", "Questions admitted with a response_format."),
    "compiles": ("kev_grammar_compiles", "response_format grammars compiled (cache misses)."),
    "cache_hits": ("kev_grammar_cache_hits", "response_format grammars found compiled in the cache."),
    "compile_seconds": ("kev_grammar_compile_seconds", "Seconds spent compiling response_format grammars."),
    "masks": ("kev_grammar_masks", "Token masks computed for constrained questions."),
    "mask_seconds": ("kev_grammar_mask_seconds", "Seconds spent computing token masks, on any thread."),
    "mask_steps": ("kev_grammar_mask_steps", "Steps that drew at least one constrained row."),
    "mask_wait_seconds": ("kev_grammar_mask_wait_seconds", "Seconds steps waited for masks before drawing."),
    "masks_late": ("kev_grammar_masks_late", "Masks computed at the draw because the worker had not."),
}


def structured_counts(constraints) -> dict[str, float]:
    grammars, masks = constraints.grammars.stats, constraints.masks.stats
    return {"constrained": constraints.questions, "compiles": grammars.compiles, "cache_hits": grammars.cache_hits,
            "compile_seconds": grammars.compile_seconds, "masks": masks.masks, "mask_seconds": masks.mask_seconds,
            "mask_steps": masks.steps, "mask_wait_seconds": masks.wait_seconds, "masks_late": masks.late}
