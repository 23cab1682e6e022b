"""`import kev`: the seeds' Python examples run as written, and what they read is there.

Seed 002's and seed 000's examples run in a subprocess, pasted as the articles print them (only the model
differs: the built-in SmolLM2); seed 002's also inside a running event loop, as in a notebook. In process,
on the tiny random model: wait()'s order per aggregator.mode, max_parallel, isolation, timeouts, and keys
Kev does not know (reported or refused). The engine's own Python paths: tests/test_engine_api.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import kev
from conftest import tiny_options
from engine import QuestionRejected
from engine.model.loader import ModelNotFound
from schemas import DEFAULT_MODEL

pytest_plugins = ["serve_fixtures"]

SEED_002 = '''
import kev
# 1. 初始化引擎，加载配置
engine = kev.Engine.from_config("kev.yaml")
# 2. 提交一批独立问题
queries = [
    "Kev的隔离通道是如何实现的？",
    "帮我总结一下Transformer的注意力机制",
    "写出一个Python快速排序示例",
    "解释一下什么是KV Cache",
]
request_id = engine.submit(
    queries,
    isolation="strict",
    max_parallel=4,
)
# 3. 轮询结果
results = engine.wait(request_id, timeout=15.0)
# 4. 每个结果都带独立的通道信息
for r in results:
    print(f"channel={r.channel_id} | time={r.elapsed_ms}ms | tokens={r.tokens}")
    print(r.text)
'''
# Not the seed's: the audit fields its aggregator section lists, printed for the test to check.
AUDIT_LINE = '''
import json
print("AUDIT " + json.dumps([{"channel_id": r.channel_id, "tokens": r.tokens, "hash_bucket": r.hash_bucket,
                              "started_at": r.started_at.timestamp(), "ended_at": r.ended_at.timestamp(),
                              "elapsed_ms": r.elapsed_ms, "text": r.text} for r in results]))
'''
# Seed 000's example; the article lost its code's ASCII punctuation in print, restored here.
SEED_000 = f'''
from kev.pipeline import IsolatedBatchPipeline
from kev.models import load_kev_model

model = load_kev_model("{DEFAULT_MODEL}", device_map="auto")
pipe = IsolatedBatchPipeline(
    model,
    max_batch_size=8,
    kv_slot_capacity=2048,
    early_stop=True
)
questions = [
    "用一句话解释TCP三次握手。",
    "写一首关于秋天的五言绝句。",
    "这段Python代码有没有内存泄漏",
]
answers = pipe.run(questions, max_new_tokens=256)
for qid, ans in answers.items():
    print(f"Q{{qid}}: {{ans}}")
'''
RESULT_LINE = re.compile(r"^channel=(\d+) \| time=([\d.]+)ms \| tokens=(\d+)$", re.MULTILINE)


def run_script(tmp_path, source: str, model: str, max_new_tokens: int = 24) -> str:
    """Run `source` as `python script.py` beside a kev.yaml naming `model`; its stdout."""
    from serve_fixtures import kev_env  # the plugin's module, once pytest has loaded it

    (tmp_path / "kev.yaml").write_text(f"core:\n  model_path: {model}\n"
                                       f"sampling:\n  max_new_tokens: {max_new_tokens}\n  temperature: 0\n")
    (tmp_path / "script.py").write_text(source)
    done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=kev_env(KEV_TEMPERATURE="0"),
                          capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def audit_of(stdout: str) -> list[dict]:
    return json.loads(stdout.split("AUDIT ", 1)[1])


def check_audit(audit: list[dict]) -> None:
    for result in audit:
        assert result["started_at"] <= result["ended_at"]
        assert abs((result["ended_at"] - result["started_at"]) * 1000 - result["elapsed_ms"]) <= 2
        assert isinstance(result["hash_bucket"], int) and result["tokens"] >= 1


@pytest.mark.slow
def test_seed_002_example_runs_as_written(tmp_path):
    out = run_script(tmp_path, SEED_002 + AUDIT_LINE, DEFAULT_MODEL)
    lines = RESULT_LINE.findall(out)
    assert len(lines) == 4, out
    assert sorted(int(channel) for channel, _, _ in lines) == [0, 1, 2, 3]  # max_parallel=4: one forward, 4 channels
    audit = audit_of(out)
    check_audit(audit)
    assert all(result["text"].strip() for result in audit)
    assert "def " in audit[2]["text"]  # slot_map: the quicksort question's answer is third, as submitted


def test_seed_002_example_runs_inside_a_running_event_loop(tmp_path, tiny_model_dir):
    cell = "import asyncio\n\nasync def notebook_cell():\n" + textwrap.indent(SEED_002 + AUDIT_LINE, "    ")
    out = run_script(tmp_path, cell + "\nasyncio.run(notebook_cell())\n", str(tiny_model_dir), max_new_tokens=6)
    assert len(RESULT_LINE.findall(out)) == 4, out
    check_audit(audit_of(out))


@pytest.mark.slow
def test_seed_000_example_runs_as_written(tmp_path):
    out = run_script(tmp_path, SEED_000, DEFAULT_MODEL)
    starts = [out.find(f"Q{qid}: ") for qid in range(3)]
    assert -1 < starts[0] < starts[1] < starts[2], out
    assert all(out[start + 4:].strip() for start in starts)  # each answer's text follows its index


# -- in process, on the tiny random model ----------------------------------------------------------

def greedy(**overrides):
    from engine.sampling_defaults import Defaults

    return tiny_options(defaults=Defaults(temperature=0.0, max_new_tokens=4), **overrides)


@pytest.fixture
def facade(tiny_model):
    def make(mode: str = "slot_map", **overrides) -> kev.Engine:
        return kev.Engine(tiny_model, greedy(**overrides), aggregator_mode=mode)
    return make


def test_pipe_run_answers_by_index_as_the_seeds_aggregator_reads_them(tiny_model):
    pipe = kev.pipeline.IsolatedBatchPipeline(tiny_model, max_batch_size=8, options=greedy())
    answers = pipe.run(["one", "two", "three"], max_new_tokens=3)
    assert [qid for qid, _ in answers.items()] == [0, 1, 2]
    assert answers.get(1) is answers[1] and answers.get(3) is None
    assert [answer.question_id for answer in answers] == ["q0", "q1", "q2"]
    assert str(answers[0]) == answers[0].text == answers[0].answer.text


@pytest.mark.parametrize("mode,expected", [("slot_map", [0, 1, 2, 3]), ("priority", [1, 3, 0, 2])])
def test_wait_orders_results_by_aggregator_mode(facade, mode, expected):
    queries = [{"prompt": "a", "priority": 0}, {"prompt": "b", "priority": 5},
               {"prompt": "c", "priority": -1}, {"prompt": "d", "priority": 5}]
    with facade(mode) as engine:
        results = engine.wait(engine.submit(queries), timeout=60)
    assert [r.slot for r in results] == expected


def test_wait_in_seq_append_mode_gives_results_as_they_finished(facade):
    queries = [{"prompt": "long", "params": {"max_new_tokens": 24}},
               {"prompt": "short", "params": {"max_new_tokens": 1}},
               {"prompt": "middle", "params": {"max_new_tokens": 8}}]
    with facade("seq_append") as engine:
        results = engine.wait(engine.submit(queries), timeout=60)
    assert [r.slot for r in results] == [1, 2, 0]
    assert [r.tokens for r in results] == [1, 8, 24]
    ended = [r.ended_at for r in results]
    assert ended == sorted(ended)


def test_max_parallel_feeds_the_queries_that_many_at_a_time(facade):
    with facade() as engine:
        alone = engine.wait(engine.submit(["a", "b", "c"], max_parallel=1, max_new_tokens=16), timeout=60)
        packed = engine.wait(engine.submit(["a", "b", "c"], max_parallel=3, max_new_tokens=16), timeout=60)
        with pytest.raises(ValueError, match="max_parallel=0"):
            engine.submit(["a"], max_parallel=0)
    assert all(r.answer.audit.batch_sizes == (1,) for r in alone)  # never two of them in one forward
    assert max(max(r.answer.audit.batch_sizes) for r in packed) >= 2


def test_isolation_strict_is_always_strict_and_sharing_must_be_the_engines(facade):
    with facade() as engine:
        assert engine.wait(engine.submit(["a"], isolation="strict"), timeout=60)[0].tokens >= 1
        with pytest.raises(ValueError, match="isolation.level: strict"):
            engine.submit(["a"], isolation="shared")
        with pytest.raises(ValueError, match=r"'loose' \(Kev's system_prefix\).*isolation.level: strict"):
            engine.submit(["a"], isolation="loose")
        with pytest.raises(ValueError, match="'strict', 'system_prefix', 'shared'"):
            engine.submit(["a"], isolation="airtight")
    with facade(prefix_caching=True) as engine:
        assert engine.isolation == "shared"
        prompt = "A long shared question that fills more than one KV block of sixteen tokens, twice over. " * 3
        engine.wait(engine.submit([prompt], isolation="shared"), timeout=60)
        shared = engine.wait(engine.submit([prompt], isolation="shared"), timeout=60)[0]
        strict = engine.wait(engine.submit([prompt], isolation="strict"), timeout=60)[0]
        # On a sharing engine, "strict" still reads nobody's cached blocks: a salt of its own per query.
        assert shared.answer.usage.cached_prompt_tokens > 0 and strict.answer.usage.cached_prompt_tokens == 0
    with facade(prefix_caching=True, prefix_system_only=True) as engine:
        engine.wait(engine.submit(["a"], isolation="loose"), timeout=60)  # the seed's name for it


def test_wait_timeout_names_the_missing_queries_and_the_request_goes_on(facade):
    with facade() as engine:
        request_id = engine.submit(["quick", "a long one"], max_parallel=1, max_new_tokens=40)
        with pytest.raises(kev.WaitTimeout, match=r"2 of 2 results missing after 0 s: slots 0 \('quick'\), "
                                                  r"1 \('a long one'\)") as timed_out:
            engine.wait(request_id, timeout=0)
        assert timed_out.value.missing == (0, 1)
        assert len(engine.wait(request_id, timeout=60)) == 2
        with pytest.raises(KeyError, match="waited for once"):
            engine.wait(request_id)


def test_from_config_builds_the_engine_the_file_describes(tmp_path, tiny_model_dir):
    config = tmp_path / "kev.yaml"
    config.write_text(f"core:\n  model_path: {tiny_model_dir}\nrouter:\n  max_parallel_queries: 3\n"
                      f"aggregator:\n  mode: priority\nsampling:\n  max_new_tokens: 2\n")
    with kev.Engine.from_config(config) as engine:
        assert engine.options.max_parallel_queries == 3 and engine.aggregator_mode == "priority"
        results = engine.wait(engine.submit(["a", {"prompt": "b", "priority": 9}]), timeout=60)
    assert [r.slot for r in results] == [1, 0] and all(r.tokens <= 2 for r in results)


def test_load_kev_model_says_what_it_can_load():
    with pytest.raises(ModelNotFound, match=f"'local/kev-7b'.*{DEFAULT_MODEL}"):
        kev.models.load_kev_model("local/kev-7b", device_map="auto")
    with pytest.raises(ValueError, match="device_map='balanced'.*'auto', 'cpu', 'cuda'"):
        kev.models.load_kev_model(DEFAULT_MODEL, device_map="balanced")


MISSPELT = "params.max_tokens (did you mean 'params.max_new_tokens'?)"


def test_kev_submit_lists_unknown_keywords_or_refuses_them_before_queueing(facade):
    with facade() as engine:
        results = engine.wait(engine.submit(["a", "b"], max_tokens=9), timeout=60)
        assert [r.answer.audit.ignored_fields for r in results] == [("params.max_tokens",)] * 2
    with facade(unknown_fields="reject") as engine:
        with pytest.raises(QuestionRejected, match=re.escape(MISSPELT)):
            engine.submit(["a", "b"], max_tokens=9)
        assert engine._engine.in_flight == 0


def test_a_wheel_installs_kev_once(tmp_path):
    """Not only the editable install: a wheel has `kev` (from kev_async/facade/kev), and kev_async without it."""
    root = Path(__file__).resolve().parents[1]
    source = tmp_path / "src"
    for package in ("schemas", "engine", "consumers", "kev_async"):
        shutil.copytree(root / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("kev-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"kev/__init__.py", "kev/sync_engine.py", "kev/pipeline.py", "kev/models.py"} <= names
    assert not [name for name in names if name.startswith("kev_async/facade")]
