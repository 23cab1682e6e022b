"""Each tenant's share of this worker, read from the engine's scheduler at scrape time (label `tenant`: its
name, "anonymous" for unsigned questions; docs/fairness.md).

kev_tenant_service_tokens   tokens computed for it, prompt and answer (rate() of it: its service)
kev_tenant_service_share    its share of the tokens computed lately (a 10 s half-life), 0 to 1
kev_tenant_queue_seconds    its questions' time from arrival to joining the batch (a summary: _sum, _count)
kev_tenant_throttled        questions that waited because it was over a quota (tenants.<name>.max_*)
kev_tenant_throttled_seconds  that waiting, summed (part of the queue time)
kev_tenant_questions        its questions in the batch (state="running") and waiting for it (state="waiting")

Quotas and shares are per worker: a fleet's figures are the sums over its workers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily


def tenant_families(core) -> Iterator[Metric]:
    """The kev_tenant_* families of `core`'s scheduler (None: every family, empty)."""
    scheduler = core.scheduler if core is not None else None
    report = {} if scheduler is None else scheduler.sharing.report(scheduler.running, scheduler.waiting,
                                                                    time.monotonic())
    served = CounterMetricFamily("kev_tenant_service_tokens", "Tokens computed for the tenant, prompt and answer.",
                                 labels=["tenant"])
    share = GaugeMetricFamily("kev_tenant_service_share", "The tenant's share of the tokens computed lately "
                              "(a 10 s half-life).", labels=["tenant"])
    queued = SummaryMetricFamily("kev_tenant_queue_seconds", "The tenant's questions: arrival to joining the batch.",
                                 labels=["tenant"])
    throttled = CounterMetricFamily("kev_tenant_throttled", "The tenant's questions that waited over a quota "
                                    "(max_tokens_per_second, max_in_flight).", labels=["tenant"])
    throttled_s = CounterMetricFamily("kev_tenant_throttled_seconds", "Time the tenant's questions waited over a "
                                      "quota, summed.", labels=["tenant"])
    questions = GaugeMetricFamily("kev_tenant_questions", "The tenant's questions in the batch or waiting for it.",
                                  labels=["tenant", "state"])
    for tenant, entry in sorted(report.items()):
        served.add_metric([tenant], entry["served"])
        share.add_metric([tenant], entry["share"])
        queued.add_metric([tenant], entry["admitted"], entry["queued_s"])
        throttled.add_metric([tenant], entry["throttled"])
        throttled_s.add_metric([tenant], entry["throttled_s"])
        for state in ("running", "waiting"):
            questions.add_metric([tenant, state], entry[state])
    yield from (served, share, queued, throttled, throttled_s, questions)
