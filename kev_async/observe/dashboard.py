"""The view behind `kev top`: scrape one worker's Prometheus endpoint (metrics.port) and render a frame.

Rates (tokens/s, forwards/s, batch size per forward) come from the difference between two scrapes
`--interval` seconds apart; latency percentiles are estimated from the histograms since start.
"""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from schemas import DEFAULT_CONFIG

DEFAULT_PORT = DEFAULT_CONFIG.metrics.port  # kev.yaml metrics.port, declared in schemas
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}/metrics"
WORKER_METRICS = {"kev_kv_blocks_used", "kev_forwards_total"}  # only a worker exports these
CLEAR = "\x1b[H\x1b[2J"


class Unreachable(Exception):
    """The endpoint did not answer with Prometheus metrics."""


@dataclass(frozen=True)
class Sample:
    """One scrape: every sample by (name, labels), and when it was taken (time.monotonic())."""

    at: float
    values: dict[tuple[str, frozenset], float]

    def get(self, name: str, **labels: str) -> float | None:
        """The sum of `name`'s samples whose labels include `labels`; None when there are none."""
        want = set(labels.items())
        found = [v for (n, ls), v in self.values.items() if n == name and want <= ls]
        return sum(found) if found else None

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, labels), value in self.values.items():
            if n == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + value
        return out

    def quantile(self, histogram: str, q: float) -> float | None:
        """Prometheus' histogram_quantile over the cumulative buckets (linear within a bucket)."""
        buckets = sorted((float(le), count) for le, count in self.by(f"{histogram}_bucket", "le").items())
        if not buckets or buckets[-1][1] == 0:
            return None
        rank, lower, below = q * buckets[-1][1], 0.0, 0.0
        for upper, count in buckets:
            if count >= rank:
                if math.isinf(upper):
                    return lower
                return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
            lower, below = upper, count
        return lower


def scrape(url: str, timeout: float = 5.0) -> Sample:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - an operator's URL
            text = response.read().decode("utf-8")
    except urllib.error.HTTPError as error:
        raise Unreachable(f"{url} answered {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise Unreachable(f"cannot reach {url}: {reason} (is `kev serve` running with metrics.port set?)") from None
    try:
        values = {(s.name, frozenset(s.labels.items())): s.value
                  for family in text_string_to_metric_families(text) for s in family.samples}
    except ValueError as error:
        raise Unreachable(f"{url} did not return Prometheus metrics: {error}") from None
    if not any(name.startswith("kev_") for name, _ in values):
        raise Unreachable(f"{url} serves metrics, but none of Kev's")
    if not any(name in WORKER_METRICS for name, _ in values):  # e.g. a gateway's /metrics
        raise Unreachable(f"{url} serves Kev metrics, but not a worker's: point --url at a `kev serve` "
                          f"worker's metrics port (metrics.port, {DEFAULT_PORT} by default; `kev demo` prints its own)")
    return Sample(time.monotonic(), values)


def render(now: Sample, before: Sample | None, url: str, interval: float) -> str:
    def rate(name: str) -> float | None:
        if before is None or now.at <= before.at:
            return None
        return ((now.get(name) or 0.0) - (before.get(name) or 0.0)) / (now.at - before.at)

    def delta(name: str) -> float:
        return (now.get(name) or 0.0) - ((before.get(name) or 0.0) if before else 0.0)

    forwards = delta("kev_step_batch_size_count")
    batch = delta("kev_step_batch_size_sum") / forwards if forwards else None
    used, free = now.get("kev_kv_blocks_used"), now.get("kev_kv_blocks_free")
    share = f"({100 * used / (used + free):.1f}% used)" if used is not None and free else ""
    mailboxes = now.by("kev_mailbox_depth", "mailbox")
    capacity = now.by("kev_mailbox_capacity", "mailbox")
    lag = {f"{dict(ls)['topic']}/{dict(ls)['partition']}": v
           for (n, ls), v in sorted(now.values.items()) if n == "kev_consumer_lag"}
    latency = "   ".join(f"{label} p50 {_secs(now.quantile(h, 0.5))} p99 {_secs(now.quantile(h, 0.99))}"
                         for label, h in (("ttft", "kev_time_to_first_token_seconds"),
                                          ("itl", "kev_inter_token_latency_seconds"),
                                          ("e2e", "kev_end_to_end_latency_seconds")))
    rows = [
        ("questions", f"running {_n(now.get('kev_running_questions'))}   waiting "
                      f"{_n(now.get('kev_waiting_questions'))}   kafka in flight {_n(now.get('kev_kafka_in_flight'))}"),
        ("batch", f"{_f(batch)} per forward   forwards {_n(now.get('kev_forwards_total'))} "
                  f"({_f(rate('kev_forwards_total'))}/s)   preemptions {_n(now.get('kev_preemptions_total'))}"),
        ("kv blocks", f"used {_n(used)}   free {_n(free)}   {share}"),
        ("tokens", f"generated {_n(now.get('kev_generated_tokens_total'))}   "
                   f"{_f(rate('kev_generated_tokens_total'))} tok/s"),
        ("latency", f"{latency}   (since start)"),
        ("answers", _pairs(now.by("kev_answers_total", "finish_reason"))),
        ("errors", _pairs(now.by("kev_errors_total", "code"))),
        ("mailboxes", "   ".join(f"{name} {_n(depth)}/{_n(capacity.get(name))}" for name, depth in mailboxes.items())
         or "-"),
        ("kafka", f"assigned {_n(now.get('kev_kafka_assigned_partitions'))}   paused "
                  f"{_n(now.get('kev_kafka_paused_partitions'))}   lag {_n(sum(lag.values()) if lag else None)}"
                  + (f" ({_pairs(lag)})" if lag else "")),
    ]
    stamp = time.strftime("%H:%M:%S")
    return "\n".join([f"kev top  {url}  every {interval:g}s  {stamp}", *(f"{k:<10} {v}" for k, v in rows)])


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _pairs(counts: dict[str, float] | Iterable) -> str:
    shown = [f"{key} {value:.0f}" for key, value in dict(counts).items() if value]
    return "  ".join(shown) or "-"
