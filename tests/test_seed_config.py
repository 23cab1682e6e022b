"""Seed 002's kev.yaml (§3.2) as printed, and the seed config values that must mean something.

- the file loads with its `kev:` root or without, and `kev config check` prints what each seed key became;
- a seed value that cannot mean what the seed says is an error naming its key; unknown keys stay errors;
- `isolation.level: loose` (system_prefix) shares a system prompt's KV blocks and never a user turn's;
- a question whose adapter finds every resident slot busy waits for one and is answered;
- `KEV_TEMPERATURE=` means unset; a core.model_path that does not exist fails check and serve in one line;
- `kev serve` runs on the seed's file, logs its mappings, and caps a forward at max_parallel_queries.
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from pathlib import Path

import anyio
import msgspec
import pytest

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures")
from kafka_fixtures import kafka_config  # noqa: E402
from serve_fixtures import (  # noqa: E402
    KEV,
    ROOT,
    STARTUP_TIMEOUT,
    AnswerReader,
    KevProcess,
    kev_env,
    kev_processes,
    log_events,
    serve_env,
    wait_assigned,
)

from engine.model.loader import BUILTIN_MODELS  # noqa: E402
from kev_async.cli import main  # noqa: E402
from kev_async.settings import load_config, load_config_with_mappings  # noqa: E402
from schemas import DEFAULT_CONFIG, DEFAULT_MODEL, ConfigError, Params, QuestionEvent  # noqa: E402
from schemas.config import BUILTIN_MODEL_NAMES  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]

# Seed 002 §3.2, as printed (the article runs it onto one line; here with its line breaks), with
# core.model_path pointing at the built-in model instead of the article's ./models/kev-7b.
SEED_002 = """\
kev:
  deploy:
    mode: single # single | multi_gpu | distributed
    workers: 1 # 推理工作进程数
  router:
    strategy: semantic_hash # semantic_hash | round_robin | length_aware
    max_parallel_queries: 8 # 一次前向内最大并发问题数
    channel_pool_size: 16 # 通道池上限
    overflow_policy: wait # wait | queue | reject
  isolation:
    level: strict # strict | loose | shared
    shared_prefix: true # 是否启用公共前缀共享
    kv_cache: split # split | shared_readonly | unified
  core:
    model_path: smollm2-135m-instruct
    precision: fp16 # fp16 | bf16 | int8
    max_context: 4096 # 单通道上下文窗口上限
  aggregator:
    mode: slot_map # slot_map | seq_append | priority
    timeout_ms: 10000 # 单通道超时时间
"""
SEED_002_MAPPINGS = [
    "# seed root kev: → its sections are read as the file's top level",
    "# seed key isolation.kv_cache: split → nothing to set: each question's KV blocks are its own, taken as its "
    "tokens arrive, never a max_context slot up front (Kev's paged pool)",
    "# seed key isolation.shared_prefix: true → isolation.level: system_prefix (from isolation.level: strict)",
]


def without_root(text: str) -> str:
    return "\n".join(line[2:] for line in text.splitlines()[1:]) + "\n"


def write(tmp_path: Path, text: str, name: str = "kev.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems(text: str, tmp_path: Path) -> dict[str, str]:
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text), env={})
    return dict(error.value.problems)


# -- the seed's file -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [SEED_002, without_root(SEED_002)], ids=["kev-root", "no-root"])
def test_seed_kev_yaml_as_printed_passes_config_check_and_shows_its_mappings(tmp_path, capsys, text):
    assert main(["config", "check", str(write(tmp_path, text)), "--no-env"]) == 0
    out = capsys.readouterr().out
    comments = [line for line in out.splitlines() if line.startswith("#")]
    assert comments == (SEED_002_MAPPINGS if text is SEED_002 else SEED_002_MAPPINGS[1:])
    cfg = load_config(write(tmp_path, text), env={})
    assert (cfg.router.max_parallel_queries, cfg.router.channel_pool_size, cfg.router.strategy) == (8, 16,
                                                                                                      "semantic_hash")
    assert (cfg.isolation.level, cfg.core.precision, cfg.core.max_context) == ("system_prefix", "fp16", 4096)
    assert (cfg.aggregator.mode, cfg.aggregator.timeout_ms, cfg.router.overflow_policy) == ("slot_map", 10000, "wait")


@pytest.mark.parametrize("yaml_text, expected, mapping", [
    ("deploy: {mode: multi_gpu}", {"deploy.mode": "multi"}, "deploy.mode: multi_gpu → deploy.mode: multi"),
    ("isolation: {level: loose}", {"isolation.level": "system_prefix"},
     "isolation.level: loose → isolation.level: system_prefix"),
    ("isolation: {shared_prefix: true}", {"isolation.level": "system_prefix"},
     "isolation.shared_prefix: true → isolation.level: system_prefix"),
    ("isolation: {level: shared, shared_prefix: true}", {"isolation.level": "shared"},
     "isolation.shared_prefix: true → isolation.level: shared"),
    ("isolation: {shared_prefix: false}", {"isolation.level": "strict"},
     "isolation.shared_prefix: false → isolation.level: strict"),
    ("isolation: {kv_cache: shared_readonly}", {"isolation.level": "system_prefix"},
     "isolation.kv_cache: shared_readonly → isolation.level: system_prefix"),
    ("isolation: {kv_cache: unified}", {"isolation.level": "strict"},
     "isolation.kv_cache: unified → nothing to set: Kev keeps one preallocated block pool"),
    ("core: {precision: int8}", {"core.precision": "auto", "core.weights": "int8"},
     "core.precision: int8 → core.weights: int8, core.precision: auto"),
    ("isolation: {ignore_pad_in_attention: true}", {"isolation.level": "strict"},
     "isolation.ignore_pad_in_attention: true → nothing to set: Kev never pads"),
    ("kv_cache: {contiguous_first: true}", {"kv_cache.num_blocks": None},
     "kv_cache.contiguous_first: true → nothing to set: Kev's allocator always takes a contiguous run"),
], ids=["multi_gpu", "loose", "shared_prefix", "shared-level-stands", "no-shared_prefix", "shared_readonly",
        "unified", "int8", "ignore_pad", "contiguous"])
def test_each_seed_spelling_becomes_one_kev_key_and_says_so(tmp_path, yaml_text, expected, mapping):
    cfg, mappings = load_config_with_mappings(write(tmp_path, yaml_text + "\n"), env={})
    for dotted, value in expected.items():
        section, key = dotted.split(".")
        assert getattr(getattr(cfg, section), key) == value, dotted
    assert len(mappings) == 1 and mapping in mappings[0], mappings


@pytest.mark.parametrize("yaml_text, key, says", [
    ('isolation: {shared_prefix: "yes"}', "isolation.shared_prefix", "expected true or false, got 'yes'"),
    ("isolation: {kv_cache: shared_readonly, shared_prefix: false}", "isolation.kv_cache",
     "shared_readonly shares read-only prefix blocks, but isolation.shared_prefix is false"),
    ("isolation: {level: shared, shared_prefix: false}", "isolation.shared_prefix",
     "false contradicts isolation.level: shared"),
    ("isolation: {kv_cache: paged}", "isolation.kv_cache", "'paged' is not one of: split, shared_readonly, unified"),
    ("core: {precision: int8, weights: full}", "core.precision", "but core.weights is 'full'"),
    ("isolation: {ignore_pad_in_attention: false}", "isolation.ignore_pad_in_attention", "Kev packs questions "
                                                                                          "without padding"),
    ("kv_cache: {contiguous_first: false}", "kv_cache.contiguous_first", "always prefers contiguous block runs"),
    ("router: {max_parallel_queries: 8, channel_pool_size: 4}", "router",
     "channel_pool_size: 4 is below max_parallel_queries (8)"),
    ("isolation: {share_prefix: true}", "isolation.share_prefix", "unknown key"),
    ("kev: {core: {}}\ndeploy: {}", "kev", "a `kev:` root holds the whole config; found beside it: deploy"),
], ids=["shared_prefix-not-bool", "kv_cache-conflict", "level-conflict", "kv_cache-unknown", "int8-vs-weights",
        "pad-false", "contiguous-false", "pool-below-batch", "unknown-key", "root-beside"])
def test_seed_values_that_cannot_mean_what_they_say_are_errors_naming_the_key(tmp_path, yaml_text, key, says):
    found = problems(yaml_text + "\n", tmp_path)
    assert key in found and says in found[key], found


def test_every_seed_key_used_gets_its_own_line(tmp_path):
    text = "isolation: {shared_prefix: true, kv_cache: shared_readonly, ignore_pad_in_attention: true}\n"
    cfg, mappings = load_config_with_mappings(write(tmp_path, text), env={})
    assert cfg.isolation.level == "system_prefix"
    assert [m.split(":")[0] for m in mappings] == ["seed key isolation.shared_prefix", "seed key isolation.kv_cache",
                                                   "seed key isolation.ignore_pad_in_attention"]


def test_a_seed_error_and_a_schema_error_are_reported_together(tmp_path, capsys):
    path = write(tmp_path, 'isolation: {shared_prefix: "yes"}\nscheduler: {batch_window_ms: -1}\n')
    assert main(["config", "check", str(path), "--no-env"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"{path}: isolation.shared_prefix: expected true or false, got 'yes'",
                     f"{path}: scheduler.batch_window_ms: -1 is below 0 (allowed: 0 to 1000)"]


def test_the_channel_pool_is_how_many_questions_a_worker_holds():
    from engine import EngineOptions
    from schemas import config_from_dict

    seeded = EngineOptions.from_config(config_from_dict({"router": {"max_parallel_queries": 8,
                                                                    "channel_pool_size": 16}}))
    default = EngineOptions.from_config(config_from_dict({"router": {"max_parallel_queries": 8}}))
    assert (seeded.max_parallel_queries, seeded.max_in_flight, default.max_in_flight) == (8, 16, 16)
    assert EngineOptions.from_config(DEFAULT_CONFIG).max_in_flight == 64  # two batches of 32, as before


# -- the environment -------------------------------------------------------------------------------------

def test_empty_env_values_mean_unset(tmp_path):
    path = write(tmp_path, "sampling: {temperature: 0.4}\n")
    assert load_config(env={"KEV_TEMPERATURE": ""}).sampling.temperature == DEFAULT_CONFIG.sampling.temperature
    assert load_config(path, env={"KEV_TEMPERATURE": "", "KEV_SCHEDULER__BATCH_WINDOW_MS": " "}) == load_config(
        path, env={})
    assert load_config(path, env={"KEV_TEMPERATURE": "0.9"}).sampling.temperature == 0.9


# -- core.model_path -------------------------------------------------------------------------------------

def test_the_built_in_names_are_the_loaders():
    assert set(BUILTIN_MODEL_NAMES) == set(BUILTIN_MODELS) and DEFAULT_MODEL in BUILTIN_MODEL_NAMES


def test_a_missing_model_path_fails_config_check_in_one_line(tmp_path, capsys):
    path = write(tmp_path, SEED_002.replace("smollm2-135m-instruct", "./models/kev-7b"))
    assert main(["config", "check", str(path), "--no-env"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"{path}: core.model_path: ./models/kev-7b does not exist (a model folder, "
                                         f"a .gguf file, or a built-in name: {DEFAULT_MODEL})"]


def test_kev_serve_on_a_missing_model_path_exits_with_one_line(tmp_path):
    path = write(tmp_path, SEED_002.replace("smollm2-135m-instruct", str(tmp_path / "no-such-model")))
    done = subprocess.run([str(KEV), "serve", "--config", str(path)], cwd=ROOT, env=kev_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"kev serve: core.model_path: {tmp_path / 'no-such-model'} does not exist "
                                        f"(a model folder, a .gguf file, or a built-in name: {DEFAULT_MODEL})"]


# -- isolation.level: loose → system_prefix, through the engine ------------------------------------------

SYSTEM = ("You answer questions about the sea for a museum. Keep every answer short, name your sources, "
          "and never guess a date you do not know; say so instead.")
USER = "Which whales sing, and how far does their song carry under water in the open ocean?"


def _cached_tokens(model, level: str, user_turns: list[str]) -> list[int]:
    """usage.cached_prompt_tokens of each question, asked one after another, under `isolation.level: level`."""
    from engine import EngineCore, EngineOptions
    from schemas import config_from_dict

    options = EngineOptions.from_config(config_from_dict({"isolation": {"level": level}}))
    core = EngineCore(model, dataclasses.replace(options, num_blocks=256, block_size=4, max_context=512,
                                                 batch_window_ms=0.0))
    cached = []
    for i, user in enumerate(user_turns):
        core.add(QuestionEvent(question_id=f"q{i}", system=SYSTEM, prompt=user, params=Params(max_new_tokens=2)))
        while core.has_work:
            cached += [a.usage.cached_prompt_tokens for a in core.step().answers]
    return cached


def test_loose_shares_the_system_prompts_blocks_and_never_a_user_turns(tiny_model, tmp_path):
    # SmolLM2's template up to where the user's text starts
    system_part = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    system_tokens = len(tiny_model.tokenizer.encode(system_part, add_special_tokens=False))
    level = load_config(write(tmp_path, "isolation: {level: loose}\n"), env={}).isolation.level

    first, same, other = _cached_tokens(tiny_model, level, [USER, USER, "Tell me about tides."])
    assert first == 0
    assert same == other == system_tokens // 4 * 4 > 0  # every full block of the system part, nothing more
    # The same prompt under `shared` reads its user turn's blocks too: loose is what keeps them private.
    assert _cached_tokens(tiny_model, "shared", [USER, USER])[1] > system_tokens


# -- adapters.max_resident: a question waits for a slot ------------------------------------------------

def test_a_question_whose_adapter_finds_every_slot_busy_waits_and_is_answered(tiny_models, tmp_path):
    from test_lora import ALL_LINEAR, QV, make_adapter

    from engine import EngineCore, EngineOptions
    from schemas import config_from_dict

    llama = tiny_models["llama"]
    options = EngineOptions.from_config(config_from_dict({"adapters": {"max_resident": 1}}))
    core = EngineCore(llama.kev, dataclasses.replace(options, num_blocks=256, max_context=256, batch_window_ms=0.0))
    core.load_adapter("a", make_adapter(llama.hf, tmp_path / "a", QV, seed=1))
    core.load_adapter("b", make_adapter(llama.hf, tmp_path / "b", ALL_LINEAR, seed=2))

    def ask(qid, adapter, timeout_ms=None):
        return core.add(QuestionEvent(question_id=qid, prompt="(ids)", adapter=adapter, timeout_ms=timeout_ms,
                                      params=Params(max_new_tokens=8, temperature=0.0)), prompt_ids=[5, 6, 7, 8])

    ask("with-a", "a")  # holds the one slot while it runs
    waiting = ask("with-b", "b")
    ask("with-b-late", "b", timeout_ms=200)
    answers = {a.question_id: a for a in core.step().answers}
    assert waiting.awaits_adapter and core.loras.resident == ["a"]
    time.sleep(0.25)  # with-b-late's deadline passes while it waits
    while core.has_work:
        answers.update((a.question_id, a) for a in core.step().answers)
    assert answers["with-a"].error is None and answers["with-b"].error is None
    assert answers["with-b"].finish_reason == "length" and len(answers["with-b"].token_ids) == 8
    assert answers["with-b"].audit.adapter == "b" and core.loras.resident == ["b"]
    late = answers["with-b-late"]
    assert late.finish_reason == "timeout" and late.error.code == "deadline_expired"
    assert "adapters.max_resident" in late.error.message


# -- kev serve on the seed's file ------------------------------------------------------------------------

@pytest.mark.kafka
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # aiokafka is asyncio-only
async def test_kev_serve_runs_the_seed_file_and_caps_a_forward_at_max_parallel_queries(
        kafka_broker, tiny_model_dir, tmp_path, anyio_backend):
    from aiokafka import AIOKafkaProducer

    from consumers import create_topics, topic_plan

    kafka = kafka_config(kafka_broker, partitions=1)
    await create_topics(kafka, topic_plan(kafka))
    config = write(tmp_path, SEED_002)  # --model: the tiny random model stands in for the built-in one
    reader = AnswerReader(kafka.bootstrap_servers, kafka.answers_topic)
    ids = [f"q{i:02d}" for i in range(16)]
    with kev_processes() as children:
        async with anyio.create_task_group() as tg:
            await tg.start(reader.run)
            kev = KevProcess(["serve", "--config", str(config), "--model", str(tiny_model_dir),
                              "--bootstrap-servers", kafka.bootstrap_servers], serve_env(kafka),
                             tmp_path / "serve.log")
            children.append(kev)
            await wait_assigned([kev])
            producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all")
            await producer.start()
            try:
                batch = producer.create_batch()  # one record batch: the worker takes all sixteen at once
                for qid in ids:
                    batch.append(timestamp=None, key=qid.encode(), value=msgspec.json.encode(
                        {"question_id": qid, "prompt": f"Count the waves, number {qid}.", "timeout_ms": 120_000,
                         "params": {"max_new_tokens": 48, "temperature": 0.0}}))
                await (await producer.send_batch(batch, kafka.questions_topic, partition=0))
            finally:
                await producer.stop()
            await reader.wait_for(ids, STARTUP_TIMEOUT, f"answers: {kev.describe()}")
            tg.cancel_scope.cancel()

    answers = {a.question_id: a for a in reader.answers}
    assert all(answers[qid].error is None for qid in ids), [answers[q].error for q in ids]
    sizes = [size for qid in ids for size in answers[qid].audit.batch_sizes]
    assert max(sizes) == 8, sizes  # sixteen questions held, eight channels in each forward
    (started,) = log_events(kev, "config.seed_keys")
    assert started["mappings"] == [line[2:] for line in SEED_002_MAPPINGS]
