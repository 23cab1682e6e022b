"""`kev bench load`: the arrival trace (Poisson spacing, seeded, the length mix), the report's math, and
the real command end to end on a tiny model (Kev's Engine, transformers static batching, Kafka).

Speed itself is never asserted; the numbers live in docs/speed.md, measured with the real model.
"""

import json
import math
import random
import statistics
import subprocess

import pytest

from kev_async.bench import machine
from kev_async.bench.load.report import Outcome, Reference, SystemRun, percentile, summarize
from kev_async.bench.load.trace import MixSpec, build_trace, poisson_arrivals, shared_system_prompt
from kev_async.bench.machine import cpu_name
from kev_async.cli import main

pytest_plugins = ["kafka_fixtures", "serve_fixtures", "gateway_fixtures"]


# -- the trace -----------------------------------------------------------------------------------------

def test_poisson_gaps_have_the_rate_and_the_spread_of_an_exponential():
    rate = 4.0
    times = poisson_arrivals(20_000, rate, seed=7)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.05)  # exponential: CV = 1
    # Memoryless: P(gap > 1/rate) = e^-1.
    assert sum(g > 1 / rate for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)


def test_same_seed_same_trace_and_a_rate_only_rescales_the_arrivals(smollm2_tokenizer):
    spec = MixSpec(max_new_tokens=64)
    a = build_trace(smollm2_tokenizer, rate=2.0, seed=3, spec=spec, count=40)
    again = build_trace(smollm2_tokenizer, rate=2.0, seed=3, spec=spec, count=40)
    faster = build_trace(smollm2_tokenizer, rate=8.0, seed=3, spec=spec, count=40)
    other = build_trace(smollm2_tokenizer, rate=2.0, seed=4, spec=spec, count=40)
    assert a == again
    assert [(q.prompt, q.max_new_tokens) for q in a] == [(q.prompt, q.max_new_tokens) for q in faster]
    assert [q.arrival_s / 4 for q in a] == pytest.approx([q.arrival_s for q in faster])
    assert [q.prompt for q in a] != [q.prompt for q in other]
    assert {q.arrival_s for q in build_trace(smollm2_tokenizer, rate=math.inf, seed=3, spec=spec, count=5)} == {0.0}


def test_a_longer_trace_only_adds_questions(smollm2_tokenizer):
    short = build_trace(smollm2_tokenizer, rate=1.0, seed=5, spec=MixSpec(), count=10)
    long = build_trace(smollm2_tokenizer, rate=1.0, seed=5, spec=MixSpec(), count=40)
    assert long[:10] == short


def test_duration_bounds_the_arrivals(smollm2_tokenizer):
    trace = build_trace(smollm2_tokenizer, rate=10.0, seed=1, spec=MixSpec(), duration_s=30.0)
    assert max(q.arrival_s for q in trace) <= 30.0
    assert len(trace) == pytest.approx(300, abs=4 * math.sqrt(300))


def test_the_mix_has_short_and_long_prompts_and_spread_budgets(smollm2_tokenizer):
    spec = MixSpec(max_new_tokens=128, min_new_tokens=4, long_fraction=0.4, max_prompt_tokens=1000)
    trace = build_trace(smollm2_tokenizer, rate=1.0, seed=0, spec=spec, count=400)
    longs = [q for q in trace if q.kind == "long"]
    assert len(longs) / len(trace) == pytest.approx(0.4, abs=0.07)
    lengths = [len(smollm2_tokenizer.encode(q.prompt)) for q in longs]
    assert max(lengths) <= 1000 + 40 and min(lengths) >= 100  # notes up to the limit, plus the task
    assert statistics.median(lengths) > 400
    budgets = [q.max_new_tokens for q in trace]
    assert 4 <= min(budgets) and max(budgets) <= 128
    assert sum(b <= 12 for b in budgets) > 60 and sum(b >= 64 for b in budgets) > 60  # log-uniform: both ends
    assert all(q.system is None for q in trace)


def test_shared_prefix_is_one_system_prompt_of_n_tokens(smollm2_tokenizer):
    trace = build_trace(smollm2_tokenizer, rate=1.0, seed=0, spec=MixSpec(shared_prefix_tokens=300), count=10)
    assert len({q.system for q in trace}) == 1
    assert len(smollm2_tokenizer.encode(trace[0].system)) == pytest.approx(300, abs=3)
    assert shared_system_prompt(smollm2_tokenizer, 300) == trace[0].system


# -- the report's math ---------------------------------------------------------------------------------

def test_percentile_interpolates_like_numpy():
    values = [random.Random(0).random() for _ in range(101)]
    ordered = sorted(values)
    assert percentile(values, 50) == ordered[50]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([], 50) is None


def test_summary_counts_completed_tokens_over_the_wall_time_and_compares_with_the_reference():
    outcomes = [
        Outcome("a", arrival_s=0.0, first_token_s=0.5, finished_s=2.0, tokens=10, token_ids=[1, 2]),
        Outcome("b", arrival_s=1.0, first_token_s=1.5, finished_s=4.0, tokens=30, token_ids=[3]),
        Outcome("c", arrival_s=2.0, first_token_s=2.1, finished_s=3.0, tokens=5, text="hi"),
        Outcome("d", arrival_s=3.0, error="boom", tokens=99),  # failed: neither tokens nor latency count
    ]
    reference = Reference({"a": [1, 2], "b": [3, 4], "c": [9]}, {"a": "", "b": "", "c": "hi"})
    s = summarize(SystemRun("x", outcomes), reference)
    assert (s["completed"], s["errors"], s["tokens"]) == (3, 1, 45)
    assert s["wall_s"] == 4.0 and s["goodput_tps"] == 45 / 4.0
    assert s["e2e_p50_s"] == 2.0 and s["ttft_p50_s"] == 0.5
    assert s["e2e_p99_s"] == pytest.approx(2.0 + 0.98 * 1.0)
    assert s["identical"] == 2  # a by tokens, c by text (a text-only system); b differs


# -- the command, end to end (tiny model) --------------------------------------------------------------

def _load(tiny_model_dir, tmp_path, *extra):
    return main(["bench", "load", "--model", str(tiny_model_dir), "--questions", "5", "--rates", "10,inf",
                 "--max-new-tokens", "6", "--max-prompt-tokens", "120", "--threads", "2",
                 "--output-json", str(tmp_path / "load.json"), "--plot", str(tmp_path / "load.png"), *extra])


def test_kev_bench_load_runs_kev_and_static_batching_and_writes_json_and_plot(tiny_model_dir, tmp_path, capsys):
    assert _load(tiny_model_dir, tmp_path, "--hf-batch-sizes", "2,4", "--hf-batch-timeout", "0.05") == 0
    out = capsys.readouterr().out
    assert "transformers static, batch   2" in out and "transformers static, batch   4" in out
    assert "kev engine vs transformers static (best: batch" in out
    result = json.loads((tmp_path / "load.json").read_text())
    assert [p["rate"] for p in result["points"]] == [10.0, 10.0, "inf", "inf"]
    kev = [p for p in result["points"] if p["system"] == "kev engine"]
    assert all(p["completed"] == 5 and p["identical"] == 5 for p in kev)  # packed == solo, greedy fp32
    assert all(p["ttft_p50_s"] <= p["e2e_p50_s"] for p in result["points"])
    assert len(result["static_sweep"]) == 4
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "load-solo-reference.json").exists()  # cached: the second rate reused it
    assert out.count("solo reference: answering") == 1
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert result["commit"] == head and result["cpu"] == cpu_name()  # archived figures name their code and CPU


def test_outside_a_clone_the_commit_is_none(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "_SOURCE_ROOT", tmp_path)  # where an installed package lives: no .git
    assert machine.run_stamp() == {"commit": None, "cpu": cpu_name()}


def test_kev_bench_load_in_deterministic_mode_on_the_library_kernel(tiny_model_dir, tmp_path, capsys):
    assert _load(tiny_model_dir, tmp_path, "--no-static", "--rates", "inf", "--plot", "", "--deterministic",
                 "--matmul", "library") == 0
    assert "matmul library" in capsys.readouterr().out
    result = json.loads((tmp_path / "load.json").read_text())
    assert result["matmul"] == "library" and result["engine_options"]["deterministic"] is True
    assert all(p["completed"] == 5 for p in result["points"])


def test_kev_bench_load_with_speculative_decoding_keeps_every_answer(tiny_model_dir, tmp_path, capsys):
    """--speculative ngram (policy auto): the engine runs with prompt lookup and its greedy answers stay
    the solo ones."""
    assert _load(tiny_model_dir, tmp_path, "--no-static", "--rates", "inf", "--plot", "", "--speculative", "ngram") == 0
    result = json.loads((tmp_path / "load.json").read_text())
    assert result["engine_options"]["speculative"] == "ngram"
    assert all(p["completed"] == 5 and p["identical"] == 5 for p in result["points"])


def test_token_gaps_pool_every_streamed_answer_and_compare_with_the_median():
    outcomes = [Outcome("a", 0.0, 0.1, 1.0, 4, gaps=[0.1, 0.1, 0.1]), Outcome("b", 0.0, 0.2, 2.0, 3, gaps=[0.1, 1.0]),
                Outcome("c", 0.0, gaps=[9.0])]  # never completed: its gaps are not counted
    s = summarize(SystemRun("x", outcomes))
    assert s["gap_p50_ms"] == pytest.approx(100) and s["gap_max_ms"] == pytest.approx(1000)
    assert s["gap_max_over_p50"] == pytest.approx(10) and s["gap_p99_over_p50"] == pytest.approx(9.64)
    assert summarize(SystemRun("static", [Outcome("a", 0.0, 0.1, 1.0, 4)]))["gap_p50_ms"] is None


def test_kev_bench_load_streams_beside_long_prompts_at_two_chunk_sizes(tiny_model_dir, tmp_path, capsys):
    """--streams: long answers decode while long prompts arrive; one Kev per --prompt-chunk-tokens value,
    each with its token gaps, the same answers, and their ratios side by side."""
    assert main(["bench", "load", "--model", str(tiny_model_dir), "--streams", "2", "--questions", "2", "--rate", "20",
                 "--max-new-tokens", "24", "--max-prompt-tokens", "200", "--no-static", "--prompt-chunk-tokens",
                 "16,0", "--threads", "2", "--output-json", str(tmp_path / "load.json"), "--plot", ""]) == 0
    out = capsys.readouterr().out
    small, whole = "kev engine (prompt_chunk_tokens=16)", "kev engine (prompt_chunk_tokens=0)"
    assert f"{small}: token gaps p99" in out and f"{small} vs {whole}: goodput" in out
    points = {p["system"]: p for p in json.loads((tmp_path / "load.json").read_text())["points"]}
    assert points[small]["completed"] == points[whole]["completed"] == 4
    assert points[small]["identical"] == points[whole]["identical"] == 4
    assert points[small]["gap_p50_ms"] > 0 and points[small]["gap_max_ms"] >= points[small]["gap_p99_ms"]


@pytest.mark.kafka
def test_kev_bench_load_via_kafka(tiny_model_dir, tmp_path, capsys):
    assert _load(tiny_model_dir, tmp_path, "--no-static", "--via-kafka", "--rates", "10", "--plot", "") == 0
    points = json.loads((tmp_path / "load.json").read_text())["points"]
    kafka = next(p for p in points if p["system"] == "kev via kafka")
    assert kafka["completed"] == 5 and kafka["identical"] == 5


def test_clear_errors_for_a_bad_url_and_bad_flags(tiny_model_dir, tmp_path, capsys):
    assert _load(tiny_model_dir, tmp_path, "--compare-url", "http://127.0.0.1:9") == 2
    assert "cannot reach http://127.0.0.1:9/v1/models" in capsys.readouterr().err
    assert _load(tiny_model_dir, tmp_path, "--compare-url", "localhost:8080") == 2
    assert "give an http:// or https:// URL" in capsys.readouterr().err
    assert _load(tiny_model_dir, tmp_path, "--rate", "0") == 2  # argparse: a rate must be above 0
    assert _load(tiny_model_dir, tmp_path, "--hf-batch-sizes", "0") == 2


@pytest.mark.kafka
def test_kev_bench_load_against_kevs_own_gateway(tiny_model_dir, tmp_path, stack, capsys):
    """--compare-url measures any OpenAI-compatible server; here Kev's gateway on the same tiny weights."""
    from gateway_fixtures import API_KEY

    assert _load(tiny_model_dir, tmp_path, "--no-static", "--rates", "10", "--plot", "",
                 "--compare-url", stack.url, "--compare-api-key", API_KEY) == 0
    points = json.loads((tmp_path / "load.json").read_text())["points"]
    gateway = next(p for p in points if p["system"].startswith("openai-compatible"))
    assert gateway["completed"] == 5 and gateway["tokens"] > 0
    assert gateway["identical"] == 5  # text-identical to Kev's solo answers: same weights, same template
