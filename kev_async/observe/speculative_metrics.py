"""Speculative decoding's metrics, read from an engine's speculation at scrape time: drafted, accepted and
verifying steps per drafter (label `method`: ngram | draft_model), the acceptance rate, and tokens per step.

The unlabelled `kev_draft_tokens` / `kev_accepted_draft_tokens` (metrics.py) stay as they were: the sums
over methods. Rates over a window are the counters' ratios, e.g.
`rate(kev_speculative_accepted_tokens_total[5m]) / rate(kev_speculative_draft_tokens_total[5m])`; the
gauges here are the same ratios since the worker started.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

METHODS = ("ngram", "draft_model")  # every series exists from the start, so rate() sees the first drafts
COUNTERS = {
    "drafted": ("kev_speculative_draft_tokens", "Draft tokens verified in forwards, by drafter (speculative.method)."),
    "accepted": ("kev_speculative_accepted_tokens", "Draft tokens the model agreed with and emitted, by drafter."),
    "verifications": ("kev_speculative_verifications", "Question-forwards that verified a draft, by drafter: each "
                      "emits 1 + its accepted draft tokens."),
}


def draft_counts(speculation) -> dict[str, int]:
    """The unlabelled sums (metrics.py's kev_draft_tokens, kev_accepted_draft_tokens); 0 without speculation."""
    if speculation is None:
        return {"draft_tokens": 0, "accepted_draft_tokens": 0}
    return {"draft_tokens": speculation.num_draft_tokens, "accepted_draft_tokens": speculation.num_accepted_draft_tokens}


def speculative_counts(core) -> dict[tuple[str, str], float]:
    """(counter key, method) -> value; all zero without an engine or for one that does not speculate."""
    speculation = core.scheduler.speculation if core is not None else None
    method = speculation.method if speculation is not None else None
    values = {} if speculation is None else {"drafted": speculation.num_draft_tokens, "verifications":
                                             speculation.num_draft_verifications,
                                             "accepted": speculation.num_accepted_draft_tokens}
    return {(key, m): (values[key] if m == method else 0) for key in COUNTERS for m in METHODS}


def speculative_families(counts: dict[tuple[str, str], float], generated: float, forwards: float,
                         question_steps: float) -> Iterator[Metric]:
    """`counts`: speculative_counts summed over this worker's engines; the rest: its engine counters."""
    for key, (name, text) in COUNTERS.items():
        family = CounterMetricFamily(name, text, labels=["method"])
        for method in METHODS:
            family.add_metric([method], counts[(key, method)])
        yield family
    rate = GaugeMetricFamily("kev_speculative_acceptance_rate", "Accepted over drafted tokens since the worker "
                             "started, by drafter (only once it has drafted).", labels=["method"])
    for method in METHODS:
        if counts[("drafted", method)]:
            rate.add_metric([method], counts[("accepted", method)] / counts[("drafted", method)])
    yield rate
    per_forward = GaugeMetricFamily("kev_tokens_per_step", "Tokens emitted per packed forward since the worker "
                                    "started (kev_generated_tokens over kev_forwards).")
    per_question = GaugeMetricFamily("kev_tokens_per_question_step", "Tokens a question emits per forward it "
                                     "draws in, since the worker started: 1 without drafts, up to 1 + "
                                     "speculative.max_draft_tokens with them.")
    if forwards:
        per_forward.add_metric([], generated / forwards)
    if question_steps:
        per_question.add_metric([], generated / question_steps)
    yield per_forward
    yield per_question
