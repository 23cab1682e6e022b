"""Key rotation on kev.control (issue 39, finding 4): a worker whose kafka.trust lost the key that signed the
commands kept on the topic used to skip them at start and serve without them, its adapters and defaults
silently reverted. It now refuses to start, naming the keys and the commands; `kev control resign` signs
them again with the new key, and the next start applies them."""

from __future__ import annotations

import subprocess
from functools import partial

import anyio
import msgspec
import pytest
import yaml

pytest.register_assert_rewrite("kafka_fixtures", "serve_fixtures")
from kafka_fixtures import kafka_config, produce, produce_records  # noqa: E402
from serve_fixtures import KEV, ROOT, AnswerReader, kev_env  # noqa: E402

from schemas import ControlEvent, KevConfig, TrustConfig  # noqa: E402
from schemas.kafka_config import TrustKey  # noqa: E402
from schemas.signing import Signer, new_ed25519_pair  # noqa: E402

pytest_plugins = ["kafka_fixtures", "serve_fixtures"]
pytestmark = [pytest.mark.kafka, pytest.mark.anyio]
ADAPTER = "style"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def named(logs, event: str) -> list[dict]:
    return [e for e in logs if e.get("event") == event]


def write_config(path, kafka, adapters_root, keys: dict, sign_key: str | None = None) -> str:
    """A kev.yaml for a `kev` child: this test's topics, the adapters' root and kafka.trust."""
    trust = {"keys": {key_id: msgspec.to_builtins(key) for key_id, key in keys.items()},
             **({"sign_key": sign_key} if sign_key else {})}
    kafka_section = {name: getattr(kafka, name) for name in (
        "bootstrap_servers", "group_id", "questions_topic", "answers_topic", "deltas_topic", "dlq_topic",
        "control_topic", "partitions")}
    path.write_text(yaml.safe_dump({"kafka": {**kafka_section, "trust": trust}, "adapters": {"root": str(adapters_root)},
                                    "core": {"max_context": 128, "device": "cpu"}, "kv_cache": {"num_blocks": 64},
                                    "metrics": {"port": 0}}))
    return str(path)


def kev(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(KEV), *args], cwd=ROOT, env=kev_env(KEV_KAFKA_SESSION_TIMEOUT_MS="3000"),
                          capture_output=True, text=True, timeout=180)


async def test_a_worker_refuses_commands_signed_by_a_removed_key_until_they_are_resigned(
        kafka_broker, tiny_model, tiny_model_dir, tmp_path, logs):
    from consumers import control_record, create_topics, topic_plan
    from kev_async.app import serve
    from adapter_fixtures import write_random_adapter
    from kev_async.runtime.lifecycle import Shutdown

    (old_private, old_public), (new_private, new_public) = new_ed25519_pair(), new_ed25519_pair()
    control = ("control",)
    kafka = kafka_config(kafka_broker, partitions=1)
    await create_topics(kafka, topic_plan(kafka))
    write_random_adapter(tmp_path / ADAPTER, tiny_model, rank=4, seed=0)
    old_operator = Signer.from_config(TrustConfig(keys={"ops-1": TrustKey(private_key=old_private, scopes=control)}))
    await produce_records(kafka.bootstrap_servers, kafka.control_topic, [
        control_record(ControlEvent(action="load_adapter", name=ADAPTER, path=ADAPTER), old_operator,
                       kafka.control_topic),
        control_record(ControlEvent(action="update_defaults", defaults={"temperature": 0.4}), old_operator,
                       kafka.control_topic)])

    # The workers were moved to the new key, and the old one removed, before the commands were signed again.
    worker_keys = {"ops-2": TrustKey(public_key=new_public, scopes=control)}
    worker_yaml = write_config(tmp_path / "worker.yaml", kafka, tmp_path, worker_keys)
    refused = await anyio.to_thread.run_sync(kev, "serve", "--config", worker_yaml, "--model", str(tiny_model_dir))
    assert refused.returncode == 2, refused.stderr[-3000:]
    line, = [line for line in refused.stderr.splitlines() if line.startswith("kev serve: ")]
    assert "signed by key(s) not in kafka.trust here (ops-1)" in line
    assert "load_adapter style (offset 0, key ops-1); update_defaults temperature (offset 1, key ops-1)" in line
    assert "kev control resign" in line
    assert "Traceback" not in refused.stderr

    # The operator signs them again: the old key's public half verifies them, the new key signs.
    resign_yaml = write_config(tmp_path / "resign.yaml", kafka, tmp_path, {
        "ops-1": TrustKey(public_key=old_public, scopes=control),
        "ops-2": TrustKey(private_key=new_private, scopes=control)}, sign_key="ops-2")
    resigned = await anyio.to_thread.run_sync(kev, "control", "resign", "--config", resign_yaml)
    assert resigned.returncode == 0, resigned.stdout + resigned.stderr[-3000:]
    lines = resigned.stdout.splitlines()
    assert [line.split(":")[0].split() for line in lines[:2]] == [
        ["resigned", "load_adapter", ADAPTER], ["resigned", "update_defaults", "temperature"]]
    assert "was signed by ops-1" in lines[0] and "now by ops-2" in lines[0]
    again = await anyio.to_thread.run_sync(kev, "control", "resign", "--config", resign_yaml, "--dry-run")
    assert [line.split()[0] for line in again.stdout.splitlines()[:2]] == ["current", "current"]

    # The next start applies them: the adapter answers, the defaults are the commanded ones.
    cfg = KevConfig(kafka=msgspec.structs.replace(kafka, trust=TrustConfig(keys=worker_keys)))
    cfg = msgspec.structs.replace(
        cfg, adapters=msgspec.structs.replace(cfg.adapters, root=str(tmp_path)),
        core=msgspec.structs.replace(cfg.core, max_context=128, device="cpu"),
        kv_cache=msgspec.structs.replace(cfg.kv_cache, num_blocks=64),
        metrics=msgspec.structs.replace(cfg.metrics, port=0))
    reader = AnswerReader(kafka.bootstrap_servers, kafka.answers_topic)
    question = msgspec.json.encode({"question_id": "with-adapter", "prompt": "Hi", "adapter": ADAPTER,
                                    "params": {"max_new_tokens": 2}})
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            await tg.start(reader.run)
            shutdown = Shutdown(drain_deadline=20.0)
            async with anyio.create_task_group() as serving:
                await serving.start(partial(serve, cfg, shutdown, model=tiny_model))
                await produce(kafka.bootstrap_servers, kafka.questions_topic, [question])
                await reader.wait_for({"with-adapter"}, 60)
                shutdown.request("test over")
            tg.cancel_scope.cancel()

    answer, = reader.answers
    assert answer.error is None and answer.audit.adapter == ADAPTER
    applied = [(e["action"], e.get("defaults")) for e in named(logs, "control.applied")]
    assert applied == [("load_adapter", None), ("update_defaults", {"temperature": 0.4})]
    assert not named(logs, "control.start_refused")
