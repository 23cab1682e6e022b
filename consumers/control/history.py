"""The control topic's history as it stands: the record kept under each key (what compaction keeps and
a restart replays) and the command in force under it, read to the end; and the two things done with it
around a key rotation.

- The start check (`refuse_unverifiable`, called by `kev serve` before it takes questions): a kept
  command signed by a key id this worker does not have would be skipped at every replay, so a
  rotation that removed the old key before its commands were signed again would revert adapters and
  defaults silently. The worker refuses to start instead (UnverifiableCommands, one line naming the
  key ids and the commands) and points at `kev control resign`. Cancels are left out: they are
  history by the time a worker starts.
- `resign` (`kev control resign`): publishes each command in force again, signed by `sign_key` with a
  sequence number above its old one, when it was signed by another key (or is no longer the record
  its key keeps). Its config must still verify the old signatures (the old key, or for Ed25519 its
  public key alone): a command it cannot verify is never signed again, since anyone can write a record
  that names a removed key. Such commands are reported, or tombstoned with `drop_unverifiable`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog
from aiokafka.structs import ConsumerRecord

from consumers.kafka_client.clients import fetch, open_consumer, open_producer
from consumers.control.reader import (
    CANCEL_KEY_PREFIX,
    Command,
    ControlGate,
    Rejected,
    Sequences,
    caught_up,
)
from consumers.kafka_client.topics import COMPACTED, create_topics
from schemas import KafkaConfig, decode_control
from schemas.signing import CONTROL, Signer, TrustKeyError, next_sequence

log = structlog.get_logger("kev.consumers.control.history")

READ_TIMEOUT_S = 15.0  # as the control reader's catch-up
RESIGN_HINT = ("sign them again with `kev control resign --config FILE` (FILE's kafka.trust holding the old keys, "
               "or their public keys, and sign_key the new one), or put the old keys back")


class UnverifiableCommands(TrustKeyError):
    """Kept commands signed by keys this worker does not have: it would revert them, so it does not start."""


@dataclass
class ControlHistory:
    kept: dict[bytes | None, ConsumerRecord] = field(default_factory=dict)  # the latest record per key
    in_force: Sequences = field(default_factory=Sequences)  # the commands a reader applied, as it judged them
    complete: bool = False  # read to the end within the timeout

    def kept_commands(self) -> list[ConsumerRecord]:
        """The kept records but cancels (history at a start), in topic order."""
        return sorted((r for key, r in self.kept.items() if not (key or b"").startswith(CANCEL_KEY_PREFIX)),
                      key=lambda record: record.offset)


async def read_history(cfg: KafkaConfig, gate: ControlGate, *, timeout: float = READ_TIMEOUT_S,
                       poll_timeout_ms: int = 100) -> ControlHistory:
    """The control topic from its first record to its end, judged as every reader judges it."""
    await create_topics(cfg, {cfg.control_topic: 1}, configs={cfg.control_topic: COMPACTED})
    history = ControlHistory()
    deadline = time.monotonic() + timeout
    # A fetch of an empty topic waits out fetch_max_wait_ms: kept short, since every start reads this.
    async with open_consumer(cfg, cfg.control_topic, fetch_max_wait_ms=min(cfg.fetch_max_wait_ms, 100)) as consumer:
        while not await caught_up(consumer):
            if time.monotonic() > deadline:
                return history
            for records in (await fetch(consumer, timeout_ms=poll_timeout_ms)).values():
                for record in records:
                    _read(history, gate, record)
    history.complete = True
    return history


def _read(history: ControlHistory, gate: ControlGate, record: ConsumerRecord) -> None:
    if record.value is None:
        history.kept.pop(record.key, None)  # a tombstone: compaction removes the key
        return
    history.kept[record.key] = record
    checked = gate.check(record)
    if isinstance(checked, Command):
        history.in_force.admit(record, checked)


def describe(record: ConsumerRecord) -> str:
    """A command in a few words: `load_adapter style`, `update_defaults temperature,top_p`."""
    try:
        event = decode_control(record.value or b"")
    except Exception:  # noqa: BLE001 - not a command: its record key says what it claimed to change
        return repr(record.key[:100]) if record.key is not None else "a record without a key"
    what = event.name or ",".join(sorted(event.defaults or {})) or event.question_id or ""
    return f"{event.action} {what}".strip()


def unverifiable(history: ControlHistory, gate: ControlGate) -> list[tuple[ConsumerRecord, Rejected]]:
    """The kept commands signed by key ids `gate` does not know."""
    found = []
    for record in history.kept_commands():
        checked = gate.check(record)
        if isinstance(checked, Rejected) and checked.reason == "unknown_key":
            found.append((record, checked))
    return found


async def refuse_unverifiable(cfg: KafkaConfig) -> None:
    """Raise UnverifiableCommands when a kept command is signed by a key id not in `cfg.trust`."""
    gate = ControlGate(cfg)
    history = await read_history(cfg, gate)
    if not history.complete:
        log.warning("control.history_incomplete", topic=cfg.control_topic, timeout_s=READ_TIMEOUT_S,
                    action="starting without checking every kept command's key")
    found = unverifiable(history, gate)
    if not found:
        return
    key_ids = sorted({rejected.key_id or "" for _, rejected in found})
    commands = [f"{describe(record)} (offset {record.offset}, key {rejected.key_id})" for record, rejected in found]
    message = (f"refusing to start: {cfg.control_topic} keeps {len(found)} command(s) signed by key(s) not in "
               f"kafka.trust here ({', '.join(key_ids)}): {'; '.join(commands)}. Skipped, they would revert "
               f"silently; {RESIGN_HINT}")
    log.error("control.start_refused", topic=cfg.control_topic, key_ids=key_ids, commands=commands,
              hint=RESIGN_HINT)
    raise UnverifiableCommands(message)


@dataclass(frozen=True)
class Outcome:
    """What `resign` did with one kept command."""

    verdict: str  # resigned | current | unverifiable | dropped | not_in_force
    command: str  # describe()
    detail: str


async def resign(cfg: KafkaConfig, *, dry_run: bool = False, drop_unverifiable: bool = False) -> list[Outcome]:
    """Publish again, signed by `cfg.trust.sign_key`, each command in force that another key signed."""
    signer = Signer.from_config(cfg.trust)
    if signer is None:
        raise TrustKeyError("kafka.trust.keys is empty: kev control resign signs with kafka.trust.sign_key")
    if CONTROL not in signer.key.scopes:
        raise TrustKeyError(f"kafka.trust.sign_key {signer.key_id!r} may not sign control commands (its scopes: "
                            f"{', '.join(sorted(signer.key.scopes))})")
    gate = ControlGate(cfg)
    history = await read_history(cfg, gate)
    if not history.complete:
        raise TimeoutError(f"could not read {cfg.control_topic} to its end within {READ_TIMEOUT_S:g} s")
    plan = [_plan(history, gate, signer, record, drop_unverifiable) for record in history.kept_commands()]
    if not dry_run:
        async with open_producer(cfg) as producer:
            for outcome, send in plan:
                if send is not None:
                    key, value, headers = send
                    await producer.send_and_wait(cfg.control_topic, value, key=key, headers=headers)
                    log.info("control.resigned", verdict=outcome.verdict, command=outcome.command,
                             detail=outcome.detail)
    return [outcome for outcome, _ in plan]


def _plan(history: ControlHistory, gate: ControlGate, signer: Signer, kept: ConsumerRecord, drop: bool):
    """(Outcome, the record to publish (key, value, headers) or None) for one kept command."""
    checked = gate.check(kept)
    if isinstance(checked, Rejected) and checked.reason == "unknown_key":
        if drop:  # a tombstone: compaction removes every command under the key
            return Outcome("dropped", describe(kept), f"signed by {checked.key_id}; tombstoned"), (kept.key, None, [])
        return Outcome("unverifiable", describe(kept), (
            f"signed by {checked.key_id}, not in this config's kafka.trust: add that key (for Ed25519 its public key "
            "suffices) to verify it, or drop it with --drop-unverifiable")), None
    if (in_force := history.in_force.current(kept.key)) is None:
        why = checked.message if isinstance(checked, Rejected) else "no command in force"
        return Outcome("not_in_force", describe(kept), f"the kept record is not applied ({why})"), None
    command, current = in_force
    if command.key_id == signer.key_id and current.offset == kept.offset:
        return Outcome("current", describe(current), f"signed by {signer.key_id}"), None
    sequence = next_sequence(above=command.stamp)
    value = current.value or b""
    headers = signer.headers(CONTROL, current.topic, current.key, value, stamp=sequence)
    return Outcome("resigned", describe(current), (
        f"was signed by {command.key_id} (sequence {command.stamp}), now by {signer.key_id} (sequence {sequence})")), \
        (current.key, value, headers)
