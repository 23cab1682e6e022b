"""One `kev bench load` invocation: its settings checked, then for each offered rate the trace against
each system, then the table, the JSON result and the plot."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import statistics
import time
from pathlib import Path

import torch

from engine import EngineOptions, load_model
from kev_async.bench.load.kev_engine import run_engine
from kev_async.bench.load.kev_kafka import run_kafka
from kev_async.bench.load.openai_compatible import CompareUrlError, probe, run_openai
from kev_async.bench.load.report import gap_line, outcomes_json, ratios, summarize, table
from kev_async.bench.load.solo_reference import solo_reference
from kev_async.bench.load.trace import MixSpec, TraceQuestion, build_trace, prompt_ids, stream_trace
from kev_async.bench.load.transformers_static import best_static
from kev_async.bench.machine import run_stamp
from kev_async.bench.model import hf_model
from kev_async.settings import set_threads

KEV = "kev engine"


class LoadBenchError(RuntimeError):
    """A setting `kev bench load` cannot run with; printed as one line, exit 2."""


def run_load(args: argparse.Namespace, out=print) -> dict:
    if args.duration is not None and args.duration <= 0:
        raise LoadBenchError("--duration must be above 0")
    if args.questions is not None and args.questions < 1:
        raise LoadBenchError("--questions must be 1 or more")
    if args.min_new_tokens > args.max_new_tokens:
        raise LoadBenchError("--min-new-tokens is above --max-new-tokens")
    if getattr(args, "streams", 0) and args.duration is not None:
        raise LoadBenchError("--streams takes --questions (the long prompts), not --duration")
    try:
        return LoadRun(args, engine_knobs(args), out).run()
    except (CompareUrlError, ValueError) as exc:
        raise LoadBenchError(str(exc)) from None


def engine_knobs(args: argparse.Namespace) -> tuple[dict, dict]:
    """--dtype/--weights/--kv-dtype/--matmul go to whichever of load_model and EngineOptions takes them;
    --deterministic (the engine's math mode) and --speculative to EngineOptions."""
    load_params = inspect.signature(load_model).parameters
    option_fields = {f.name for f in dataclasses.fields(EngineOptions)}
    load_kwargs, option_kwargs = {}, {"max_parallel_queries": args.kev_batch_size}
    if args.kv_mib:
        option_kwargs["kv_budget_bytes"] = args.kv_mib << 20
    if args.max_tokens_per_step:
        option_kwargs["max_tokens_per_step"] = args.max_tokens_per_step
    if args.isolation == "shared":
        if "prefix_caching" not in option_fields:
            raise LoadBenchError("--isolation shared: this Kev has no prefix cache (EngineOptions.prefix_caching)")
        option_kwargs["prefix_caching"] = True
    if getattr(args, "deterministic", None):
        option_kwargs["deterministic"] = True
    if getattr(args, "prompt_chunk_tokens", None):
        option_kwargs["prompt_chunk_tokens"] = args.prompt_chunk_tokens[0]
    if getattr(args, "speculative", None):
        option_kwargs["speculative"] = args.speculative  # policy auto: EngineOptions' default
    for name in ("dtype", "weights", "kv_dtype", "matmul"):
        value = getattr(args, name, None)
        if value is None:
            continue
        if name in load_params:
            load_kwargs[name] = value
        elif name in option_fields:
            option_kwargs[name] = value
        else:
            raise LoadBenchError(f"--{name.replace('_', '-')} {value}: this Kev has no `{name}` option yet "
                                 "(neither load_model nor EngineOptions takes it)")
    return load_kwargs, option_kwargs


class LoadRun:
    def __init__(self, args: argparse.Namespace, knobs: tuple[dict, dict], out=print):
        self.args, self.out = args, out
        self.load_kwargs, self.option_kwargs = knobs
        self.rates = args.rates or [args.rate]
        self.extra_body = _json_object(args.compare_body) if args.compare_body else None
        if args.compare_url:
            probe(args.compare_url)  # a bad URL fails now, not after minutes of the other systems

    def run(self) -> dict:
        set_threads(self.args.threads)
        self.model = load_model(self.args.model, **self.load_kwargs)
        self.options = EngineOptions(**self.option_kwargs)
        self.kev_variants = _kev_variants(self.options, getattr(self.args, "prompt_chunk_tokens", None))
        self.hf = None
        result = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), **run_stamp(),
                  "torch_threads": torch.get_num_threads(), "model": self.model.name, "dtype": str(self.model.dtype),
                  "engine_options": self.option_kwargs, "matmul": self.model.weights.matmul_kernel,
                  "args": {k: v for k, v in vars(self.args).items() if k != "func"}, "points": [], "static_sweep": [],
                  "traces": [], "outcomes": []}
        self.out(f"model {self.model.name} ({self.model.dtype}, matmul {result['matmul']}), {result['cpu']}, "
                 f"torch threads {result['torch_threads']}")
        for rate in self.rates:
            self._one_rate(rate, result)
        _write_json(result, self.args.output_json)
        self.out(f"result written to {self.args.output_json}")
        self._plot(result)
        return result

    def _one_rate(self, rate: float, result: dict) -> None:
        trace = self._trace(rate)
        stats = trace_stats(self.model, trace)
        self.out(f"\n== rate {_rate_text(rate)} questions/s: {stats['questions']} questions over "
                 f"{stats['arrival_span_s']:.1f} s, prompt tokens mean {stats['prompt_tokens_mean']:.0f} max "
                 f"{stats['prompt_tokens_max']}, budgets mean {stats['budget_mean']:.0f} max {stats['budget_max']}")
        reference = self._reference(trace)
        summaries = []
        for run in self._systems(trace, reference, result, rate):
            summary = {"rate": _rate_value(rate), **summarize(run, reference)}
            summaries.append(summary)
            self.out(f"  {run.name}: goodput {summary['goodput_tps']:.1f} tok/s, e2e p50 "
                     f"{summary['e2e_p50_s'] or 0:.2f} s")  # at once: a long run shows its progress
            result["outcomes"].append({"rate": _rate_value(rate), "system": run.name, "questions": outcomes_json(run)})
        self.out(table(summaries))
        base = self.kev_variants[0][0]
        for summary in summaries:
            line = gap_line(summary)
            if line:
                self.out(line)
            if summary["system"] != base:
                line = ratios(summaries, base, summary["system"])
                if line:
                    self.out(line)
        result["points"] += summaries
        result["traces"].append({"rate": _rate_value(rate), **stats})

    def _trace(self, rate: float) -> list[TraceQuestion]:
        a = self.args
        spec = MixSpec(max_new_tokens=a.max_new_tokens, min_new_tokens=a.min_new_tokens, long_fraction=a.long_fraction,
                       max_prompt_tokens=a.max_prompt_tokens, shared_prefix_tokens=a.shared_prefix)
        count = a.questions if a.questions is not None or a.duration is not None else 256
        if getattr(a, "streams", 0):
            return stream_trace(self.model.tokenizer, streams=a.streams, prompts=count, rate=rate, seed=a.seed,
                                spec=spec)
        return build_trace(self.model.tokenizer, rate=rate, seed=a.seed, spec=spec,
                           count=None if a.duration is not None else count, duration_s=a.duration)

    def _reference(self, trace):
        if self.args.no_reference:
            return None
        cache = Path(self.args.output_json).with_name("load-solo-reference.json")
        return solo_reference(self.model, self.options, trace, cache, out=self.out)

    def _systems(self, trace, reference, result: dict, rate: float):
        """Each system in turn, the same trace; yields SystemRuns."""
        for name, options in self.kev_variants:
            self.out(f"running: {name}")
            yield run_engine(self.model, options, trace, name)
        if not self.args.no_static:
            self.out(f"running: transformers static batching, sizes {self.args.hf_batch_sizes}")
            self.hf = self.hf or hf_model(self.model)
            best, sweep = best_static(self.hf, self.model, trace, self.args.hf_batch_sizes, self.args.hf_batch_timeout,
                                      lambda run: summarize(run, reference), out=self.out)
            result["static_sweep"] += [{"rate": _rate_value(rate), **s} for s in sweep]
            yield best
        if self.args.via_kafka:
            self.out("running: kev via kafka (embedded broker, in-process worker)")
            yield run_kafka(self.model, self.options, trace)
        if self.args.compare_url:
            self.out(f"running: {self.args.compare_url} ({self.args.compare_api})")
            yield run_openai(self.args.compare_url, self.model, trace, api=self.args.compare_api,
                             served_model=self.args.compare_model, extra_body=self.extra_body,
                             api_key=self.args.compare_api_key, name=self.args.compare_name)

    def _plot(self, result: dict) -> None:
        if not self.args.plot:
            return
        from kev_async.bench.load.plot import plot_load  # matplotlib, the bench extra: only to draw

        points = [{**p, "rate": float(p["rate"])} for p in result["points"]]
        title = (f"{result['model']} ({result['dtype']}), {result['cpu']}, {result['torch_threads']} threads; "
                 f"<= {self.args.max_new_tokens} new tokens, greedy")
        if plot_load(points, self.args.plot, title):
            self.out(f"plot written to {self.args.plot}")


def _kev_variants(options: EngineOptions, chunk_sizes: list[int] | None) -> list[tuple[str, EngineOptions]]:
    """Kev's engine once per --prompt-chunk-tokens value (named by it when there are several)."""
    if not chunk_sizes or len(chunk_sizes) == 1:
        return [(KEV, options)]
    return [(f"{KEV} (prompt_chunk_tokens={n})", dataclasses.replace(options, prompt_chunk_tokens=n))
            for n in chunk_sizes]


def trace_stats(model, trace: list[TraceQuestion]) -> dict:
    lengths = [len(prompt_ids(model, q)) for q in trace]
    return {"questions": len(trace), "arrival_span_s": trace[-1].arrival_s - trace[0].arrival_s,
            "long_questions": sum(q.kind == "long" for q in trace),
            "prompt_tokens_mean": statistics.mean(lengths), "prompt_tokens_max": max(lengths),
            "budget_mean": statistics.mean(q.max_new_tokens for q in trace),
            "budget_max": max(q.max_new_tokens for q in trace)}


def _write_json(result: dict, path: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=1, default=str))


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--compare-body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--compare-body must be a JSON object")
    return value


def _rate_value(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _rate_text(rate: float) -> str:
    return "inf (all at once)" if math.isinf(rate) else f"{rate:g}"
