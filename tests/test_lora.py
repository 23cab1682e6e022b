"""Multi-LoRA: PEFT adapters made here on the tiny random models, served by Kev in one packed forward.

The reference is PEFT itself: the adapter merged into the base weights (merge_and_unload), fp32.
"""

import copy
import json
import random

import anyio
import pytest
import torch

from engine import Engine, EngineCore, IsolatedBatchPipeline, QuestionRejected
from engine.adapters.files import AdapterError
from engine.model.transformer import Transformer
from schemas import Params, QuestionEvent

QV = ["q_proj", "v_proj"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 12
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")  # peft calls it
TOLERANCE = 1e-4  # fp32, max abs logit difference


def make_adapter(hf, directory, targets, *, r=4, alpha=8, rslora=False, seed=0):
    """A PEFT LoRA adapter with random, non-zero A and B, saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False)
    get_peft_model(copy.deepcopy(hf), config).save_pretrained(directory)
    return directory


def merged(hf, directory):
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf), directory).merge_and_unload().eval()


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    """Three adapters of the tiny llama: q/v only; all linear with rsLoRA; all linear, another seed."""
    root = tmp_path_factory.mktemp("adapters")
    return {"qv": make_adapter(llama.hf, root / "qv", QV, seed=1),
            "all": make_adapter(llama.hf, root / "all", ALL_LINEAR, rslora=True, seed=2),
            "other": make_adapter(llama.hf, root / "other", ALL_LINEAR, seed=3)}


def ask(core, qid, prompt, adapter=None, new_tokens=NEW_TOKENS):
    params = Params(max_new_tokens=new_tokens, temperature=0.0)
    return core.add(QuestionEvent(question_id=qid, prompt="(token ids)", adapter=adapter, params=params),
                    prompt_ids=list(prompt))


def finish(core) -> dict:
    answers = {}
    while core.has_work:
        answers.update((a.question_id, a) for a in core.step().answers)
    return answers


def alone(model, prompt, adapter_dir=None, new_tokens=NEW_TOKENS, **options):
    """The question's greedy tokens, and the logits of each draw, with nobody else in the engine."""
    core = EngineCore(model, _options(**options))
    logits = record_logits(core)
    if adapter_dir is not None:
        core.load_adapter("solo", adapter_dir)
    ask(core, "solo", prompt, "solo" if adapter_dir is not None else None, new_tokens)
    return list(finish(core)["solo"].token_ids), logits["solo"]


def record_logits(core) -> dict:
    """question id -> the logits row of each of its draws (wraps this core's runner only)."""
    seen: dict[str, list] = {}
    execute, weights = core.runner.execute, core.runner.weights

    def traced(plan, *args, **kwargs):
        def logits(hidden):
            out = Transformer.logits(weights, hidden)
            for chunk, row in zip(plan.sampled_chunks, out):
                seen.setdefault(chunk.seq.question_id, []).append(row.clone())
            return out

        weights.logits = logits
        try:
            return execute(plan, *args, **kwargs)
        finally:
            del weights.logits

    core.runner.execute = traced
    return seen


def _options(**overrides):
    from conftest import tiny_options

    return tiny_options(**overrides)


def prompts(seed, *lengths):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


# -- parity with PEFT ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3-tied"])
@pytest.mark.parametrize("targets, rslora", [(QV, False), (ALL_LINEAR, True)], ids=["q-v", "all-linear-rslora"])
def test_adapter_logits_match_peft_merged(tiny_models, tmp_path, kind, targets, rslora):
    tiny = tiny_models[kind]
    directory = make_adapter(tiny.hf, tmp_path / "adapter", targets, rslora=rslora, seed=5)
    prompt = prompts(11, 30)[0]
    tokens, rows = alone(tiny.kev, prompt, directory)
    with torch.no_grad():
        reference = merged(tiny.hf, directory)(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        base = tiny.hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    kev = torch.stack(rows)
    assert (reference - base).abs().max() > 0.1, "the adapter should change the logits"
    diff = (kev - reference).abs().max().item()
    assert diff <= TOLERANCE, f"{kind} {targets}: max |kev - peft merged| = {diff:.2e}"
    assert tokens == reference.argmax(-1).tolist()


# -- one forward, many adapters --------------------------------------------------------------------

def test_mixed_batch_gives_each_question_its_solo_answer(llama, adapters):
    same, *others = prompts(12, 20, 7, 33, 15, 26)
    plan = [("a-same", same, "qv"), ("b-same", same, "all"), ("none-same", same, None),
            ("a-1", others[0], "qv"), ("b-1", others[1], "all"), ("none-1", others[2], None),
            ("c-1", others[3], "other")]
    core = EngineCore(llama.kev, _options())
    for name in adapters:
        core.load_adapter(name, adapters[name])
    for qid, prompt, adapter in plan:
        ask(core, qid, prompt, adapter)
    answers = finish(core)
    assert core.num_forwards == NEW_TOKENS  # one prefill forward for everyone, then one per decode
    for qid, prompt, adapter in plan:
        assert answers[qid].audit.batch_sizes[0] == len(plan), qid
        assert answers[qid].audit.adapter == adapter
        solo, _ = alone(llama.kev, prompt, adapters[adapter] if adapter else None)
        assert list(answers[qid].token_ids) == solo, f"{qid} differs from its solo answer"
    outputs = {answers[q].token_ids for q in ("a-same", "b-same", "none-same")}
    assert len(outputs) == 3, "the same prompt under two adapters and none should give three answers"


def test_deterministic_mode_mixed_logits_are_bitwise_solo(llama, adapters):
    """Groups of different sizes, padded to row tiles: a row's bits do not depend on its neighbours."""
    plan = [("a-1", 20, "qv"), ("b-1", 7, "all"), ("n-1", 33, None), ("a-2", 5, "qv"), ("c-1", 12, "other")]
    core = EngineCore(llama.kev, _options(deterministic=True))
    logits = record_logits(core)
    for name in adapters:
        core.load_adapter(name, adapters[name])
    prompt_of = dict(zip((qid for qid, _, _ in plan), prompts(16, *(n for _, n, _ in plan))))
    for qid, _, adapter in plan:
        ask(core, qid, prompt_of[qid], adapter, new_tokens=6)
    finish(core)
    for qid, _, adapter in plan:
        _, solo = alone(llama.kev, prompt_of[qid], adapters[adapter] if adapter else None, 6, deterministic=True)
        assert all(torch.equal(m, s) for m, s in zip(logits[qid], solo)), f"{qid}: logits differ from solo"


def test_unknown_adapter_is_an_error_answer(llama, adapters):
    pipeline = IsolatedBatchPipeline(llama.kev, options=_options())
    pipeline.core.load_adapter("qv", adapters["qv"])
    prompt = prompts(13, 9)[0]
    with pytest.raises(QuestionRejected) as rejected:
        ask(pipeline.core, "bad", prompt, "nope")
    assert rejected.value.code == "unknown_adapter" and "nope" in rejected.value.message
    ask(pipeline.core, "ok", prompt, "qv")
    assert list(finish(pipeline.core)["ok"].token_ids) == alone(llama.kev, prompt, adapters["qv"])[0]
    answer, = pipeline.run([dict(prompt="hi", adapter="nope")])  # through the pipeline: an answer, no raise
    assert answer.finish_reason == "error" and answer.error.code == "unknown_adapter"


# -- hot load and unload, versions, LRU ------------------------------------------------------------

def test_hot_swap_keeps_each_question_on_its_admitted_version(llama, adapters):
    prompt = prompts(14, 18)[0]
    core = EngineCore(llama.kev, _options())
    v1 = core.load_adapter("t", adapters["qv"])
    old = ask(core, "old", prompt, "t")
    for _ in range(3):  # prefill and two decodes under version 1
        core.step()
    v2 = core.load_adapter("t", adapters["all"])  # replaced while "old" is running
    new = ask(core, "new", prompt, "t")
    core.step()
    core.unload_adapter("t")  # gone for newcomers; both admitted questions carry on
    with pytest.raises(QuestionRejected) as rejected:
        ask(core, "late", prompt, "t")
    answers = finish(core)
    assert rejected.value.code == "unknown_adapter"
    assert (v1.version, v2.version) == (1, 2)
    assert old.cache_namespace == ("t", 1) and new.cache_namespace == ("t", 2)
    assert list(answers["old"].token_ids) == alone(llama.kev, prompt, adapters["qv"])[0]
    assert list(answers["new"].token_ids) == alone(llama.kev, prompt, adapters["all"])[0]
    assert core.loras.resident == [] and not core.loras._holds


def test_lru_evicts_idle_adapters_only(llama, adapters):
    prompt = prompts(15, 10)[0]
    core = EngineCore(llama.kev, _options(max_loras=2))
    for name in ("qv", "all", "other"):
        core.load_adapter(name, adapters[name])
    assert core.loras.resident == ["all", "other"]  # "qv", least recently used and idle, went first
    loads = core.loras.num_loads
    ask(core, "q-qv", prompt, "qv")  # read back from its path; evicts "all"
    assert core.loras.resident == ["other", "qv"] and core.loras.num_loads == loads + 1
    ask(core, "q-other", prompt, "other")  # resident: no load, just most recently used
    assert core.loras.resident == ["qv", "other"] and core.loras.num_loads == loads + 1
    waiting = ask(core, "q-all", prompt, "all")  # both slots are held by questions in flight: it waits
    assert waiting.awaits_adapter and core.loras.resident == ["qv", "other"]
    answers = finish(core)
    assert list(answers["q-qv"].token_ids) == alone(llama.kev, prompt, adapters["qv"])[0]
    assert core.loras.resident == ["other", "all"]  # "qv", let go first and least recently used, made room
    assert list(answers["q-all"].token_ids) == alone(llama.kev, prompt, adapters["all"])[0]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_engine_loads_and_unloads_while_serving(adapters, smollm2_tokenizer, harness, backend):
    """The async Engine applies load/unload on its device thread, between steps, with no restart."""
    wide = harness.build_hf_tiny("llama", seed=100, vocab_size=49152)  # the tokenizer's ids need the vocab
    model = harness.kev_model_from_hf(wide, smollm2_tokenizer, name="tiny-llama-wide")
    question = dict(prompt="Name a colour.", params=dict(max_new_tokens=6, temperature=0.0))

    async def main():
        async with Engine(model, _options()) as engine:
            await engine.load_adapter("a", adapters["qv"])
            with_a = await engine.wait(await engine.submit({**question, "question_id": "1", "adapter": "a"}))
            base = await engine.wait(await engine.submit({**question, "question_id": "2"}))
            await engine.unload_adapter("a")
            gone = await engine.wait(await engine.submit({**question, "question_id": "3", "adapter": "a"}))
            with pytest.raises(AdapterError):  # the error reaches the caller; the engine serves on
                await engine.load_adapter("broken", adapters["qv"].parent)
            return with_a, base, gone

    with_a, base, gone = anyio.run(main, backend=backend)
    assert with_a.error is None and base.error is None and with_a.token_ids != base.token_ids
    assert gone.finish_reason == "error" and gone.error.code == "unknown_adapter"


# -- what must not load ----------------------------------------------------------------------------

def _edit_config(directory, **changes):
    file = directory / "adapter_config.json"
    config = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    file.write_text(json.dumps(config))


@pytest.mark.parametrize("changes, says", [
    (dict(r=8), "r is 8 in adapter_config.json"),
    (dict(r=0), "r must be a positive integer"),
    (dict(lora_alpha=0), "lora_alpha must be a positive number"),
    (dict(lora_alpha=None), "lora_alpha must be a positive number"),
    (dict(target_modules=["q_proj"]), "target_modules ['q_proj'] do not match the weights"),
    (dict(target_modules=["q_proj", "v_proj", "lm_head"]), "not lm_head"),
    (dict(base_model_name_or_path="meta-llama/Llama-2-7b-hf"), "base_model_name_or_path"),
    (dict(use_dora=True), "use_dora"),
], ids=["rank", "rank-zero", "alpha-zero", "alpha-missing", "targets", "target-unsupported", "base-model", "dora"])
def test_mismatched_adapter_is_refused_by_name(llama, adapters, tmp_path, changes, says):
    import shutil

    directory = shutil.copytree(adapters["qv"], tmp_path / "bad")
    _edit_config(directory, **changes)
    core = EngineCore(llama.kev, _options())
    core.load_adapter("bad", adapters["qv"])  # a good version first: a failed reload must not replace it
    with pytest.raises(AdapterError) as error:
        core.load_adapter("bad", directory)
    assert "adapter 'bad'" in str(error.value) and says in str(error.value), str(error.value)
    assert core.loras.acquire("bad").version == 1


def test_shapes_of_another_base_model_are_refused(llama, tmp_path, harness):
    other = harness.build_hf_tiny("llama", intermediate_size=96)
    directory = make_adapter(other, tmp_path / "other-base", ALL_LINEAR)
    core = EngineCore(llama.kev, _options())
    with pytest.raises(AdapterError, match=r"adapter 'x': layer 0 gate_proj: shapes .* 64 -> 128"):
        core.load_adapter("x", directory)


def test_scaling_comes_from_the_config(llama, adapters, tmp_path):
    import shutil

    directory = shutil.copytree(adapters["all"], tmp_path / "alpha")  # rsLoRA, r=4
    _edit_config(directory, lora_alpha=16)
    core = EngineCore(llama.kev, _options())
    assert core.load_adapter("a", directory).config.scaling == 16 / 2


# -- adapters that fail to read, and an engine actor that restarts (issue 26, item 8) ---------------

@pytest.fixture(scope="module")
def wide(harness, smollm2_tokenizer):
    """The tiny Llama with SmolLM2's vocabulary, so real prompts can be asked through the async Engine."""
    hf = harness.build_hf_tiny("llama", seed=100, vocab_size=49152)
    return harness.kev_model_from_hf(hf, smollm2_tokenizer, name="tiny-llama-wide")


def _question(qid, adapter=None, **params) -> QuestionEvent:
    return QuestionEvent(question_id=qid, prompt="Name a colour.", adapter=adapter,
                         params=Params(temperature=0.0, **params))


@pytest.mark.parametrize("broken", ["adapter_model.safetensors", "adapter_config.json"])
def test_a_corrupt_adapter_read_back_after_eviction_fails_only_its_questions(adapters, wide, tmp_path, broken):
    import shutil

    directory = shutil.copytree(adapters["qv"], tmp_path / "a")

    async def main():
        async with Engine(wide, _options(max_loras=1)) as engine:
            await engine.load_adapter("a", directory)
            await engine.load_adapter("b", adapters["all"])  # "a" is evicted: read back from disk when asked for
            (directory / broken).write_bytes(b"\x00 cut short by a bad disk")
            handles = [await engine.submit(_question(qid, adapter, max_new_tokens=6))
                       for qid, adapter in (("with-a", "a"), ("with-b", "b"), ("base", None))]
            with anyio.fail_after(30):
                answers = {h.question_id: await engine.wait(h) for h in handles}
                later = await engine.wait(await engine.submit(_question("later", "b", max_new_tokens=6)))
            return answers, later, engine.closed

    answers, later, closed = anyio.run(main)
    failed = answers["with-a"]
    assert failed.finish_reason == "error" and failed.error.code == "adapter_error"
    assert "adapter 'a'" in failed.error.message and "could not be read" in failed.error.message
    assert answers["with-b"].error is None and answers["base"].error is None
    assert later.error is None and len(later.token_ids) == 6 and not closed  # the device thread lives on


def test_a_restarted_engine_actor_keeps_its_adapters_and_defaults(adapters, wide):
    import threading
    from functools import partial
    from pathlib import Path

    from kev_async.engine_actor import LoadAdapter, Submit, UpdateDefaults, engine_actor
    from kev_async.engine_state import ControlState
    from kev_async.runtime.actors import Mailbox, ask
    from kev_async.runtime.supervisor import Child, RestartPolicy, Supervisor

    made: list[Engine] = []
    device_lost = threading.Event()

    def make_engine() -> Engine:
        engine = Engine(wide, _options())
        if not made:  # the first engine's device fails at its first step once `device_lost` is set
            step = engine.core.step
            engine.core.step = lambda: _raise(RuntimeError("device lost")) if device_lost.is_set() else step()
        made.append(engine)
        return engine

    async def main():
        questions, answers = Mailbox("questions", 8), Mailbox("answers", 8)
        actor = partial(engine_actor, engine_factory=make_engine, state=ControlState())
        supervisor = Supervisor("app", [Child("scheduler", actor, (questions.receive, answers.send),
                                              RestartPolicy(backoff_s=0))])
        got = {}
        with questions.receive, answers.receive:
            async with anyio.create_task_group() as tg:
                await tg.start(supervisor.run)
                async with questions.send as inbox:
                    await ask(inbox, LoadAdapter("a", adapters["qv"], command_id=1), 30)
                    got["loaded"] = await ask(inbox, LoadAdapter("a", adapters["all"], command_id=2), 30)
                    got["defaults"] = await ask(inbox, UpdateDefaults({"max_new_tokens": 5}, command_id=3), 30)
                    for name in ("before", "lost", "after"):
                        if name == "lost":
                            device_lost.set()
                        await inbox.send(Submit(_question(name, "a")))
                        got[name] = await answers.receive.receive()
                    # The control topic replayed into the new engine: applied once already, not again.
                    got["replayed"] = await ask(inbox, LoadAdapter("a", adapters["all"], command_id=2), 30)
        return got, supervisor.restarts

    got, restarts = anyio.run(main)
    assert restarts == {"scheduler": 1} and len(made) == 2
    assert got["lost"].error.code == "engine_failed"
    before, after = got["before"], got["after"]
    assert got["loaded"].version == 2 and got["defaults"] == 2
    assert after.error is None and after.audit.adapter == "a" and after.audit.defaults_version == 2
    assert after.usage.completion_tokens <= 5  # the updated default, not the configured 256
    assert after.token_ids == before.token_ids  # the same adapter version computed it
    new = made[-1].core.loras
    assert new.current("a") == (Path(adapters["all"]), 2) and new.num_loads == 1
    assert got["replayed"].version == 2


def _raise(error):
    raise error


# -- adapter files are read as regular files only (review of issue 26) -------------------------------

@pytest.mark.parametrize("replace", ["symlink-outside", "dev-zero", "fifo", "too-large"])
def test_an_adapter_file_that_is_not_a_plain_file_is_refused_without_hanging(llama, adapters, tmp_path, replace):
    import os
    import shutil

    from engine.adapters.files import load_adapter

    directory = shutil.copytree(adapters["qv"], tmp_path / "a")
    config = directory / "adapter_config.json"
    outside = shutil.copy(config, tmp_path / "elsewhere.json")  # a valid config, but not in the adapter
    config.unlink()
    if replace == "symlink-outside":
        config.symlink_to(outside)
    elif replace == "dev-zero":
        config.symlink_to("/dev/zero")
    elif replace == "fifo":
        os.mkfifo(config)  # no writer ever comes: opening it for reading would wait for good
    else:
        config.write_text(json.dumps({"r": 4, "lora_alpha": 8, "padding": "x" * (1 << 20)}))
    says = {"symlink-outside": "symbolic link", "dev-zero": "symbolic link", "fifo": "not a regular file",
            "too-large": "at most 1048576"}[replace]
    with _no_hang(10):
        with pytest.raises(AdapterError, match=says) as refused:
            load_adapter("a", directory, llama.kev)
    assert "adapter 'a'" in str(refused.value) and "adapter_config.json" in str(refused.value)


def test_a_symlinked_weights_file_is_refused(llama, adapters, tmp_path):
    import shutil

    from engine.adapters.files import load_adapter

    directory = shutil.copytree(adapters["qv"], tmp_path / "a")
    weights = directory / "adapter_model.safetensors"
    moved = weights.rename(tmp_path / "weights.safetensors")
    weights.symlink_to(moved)
    with pytest.raises(AdapterError, match="symbolic link"):
        load_adapter("a", directory, llama.kev)
    weights.unlink()
    moved.rename(weights)  # the same bytes as a plain file load
    assert load_adapter("a", directory, llama.kev).config.rank == 4


def _no_hang(seconds: int):
    """Fails the test (SIGALRM) instead of letting a blocking read hang the run."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def alarm():
        def fail(*_):
            raise AssertionError(f"still reading after {seconds}s")

        previous = signal.signal(signal.SIGALRM, fail)
        signal.alarm(seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    return alarm()
