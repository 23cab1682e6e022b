"""The control topic's gate: which records are commands that may be applied (signed for their key's
purpose, decodable, keyed by what they change) and, per record key, whether a command's sequence
number is above the last one applied (`Sequences`). Shared by the control readers and the audit."""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from aiokafka.structs import ConsumerRecord

from consumers.kafka_client.record_guard import unreadable
from schemas import ControlEvent, InvalidControl, KafkaConfig, control_key, decode_control
from schemas.signing import CANCEL, CONTROL, Purpose, Verification, Verifier

log = structlog.get_logger("kev.consumers.control.reader")

CANCEL_KEY_PREFIX = b"cancel:"  # a cancel's record key (control_key): signed for CANCEL, every other command CONTROL


def purpose_of(key: bytes | None) -> Purpose:
    """What a control record is signed for: CANCEL under a cancel's key, CONTROL under any other. The gate
    then holds the command to that key (wrong_key), so a cancel-only key can sign nothing but cancels."""
    return CANCEL if key is not None and key.startswith(CANCEL_KEY_PREFIX) else CONTROL


@dataclass(frozen=True)
class Rejected:
    """Why a control record is not applied; `reason` goes to the dead letter's dlq.reason header."""

    # unsigned | forged | unknown_key | out_of_scope | wrong_key | stale_sequence | decode_crashed |
    # InvalidControl's reasons | the fetch guard's reasons
    reason: str
    message: str
    key_id: str | None = None  # the key a signed, forged or out-of-scope record named


@dataclass(frozen=True)
class Command:
    """A control record that passed the gate: its command, who signed it, and its signed stamp."""

    event: ControlEvent
    key_id: str
    stamp: int  # the sequence number (a command) or the signing time in ms (a cancel)


class ControlGate:
    """The checks a control record passes before it is applied: signature (topic, key, scope), then decoding,
    then its record key. The sequence number is checked against the history by `Sequences`."""

    def __init__(self, cfg: KafkaConfig) -> None:
        self.verifier = Verifier.from_config(cfg.trust)
        self.max_bytes = cfg.limits.max_control_bytes

    def check(self, record: ConsumerRecord) -> Command | Rejected:
        if (broken := unreadable(record)) is not None:  # never a command, whatever it says
            return Rejected(broken.reason, broken.message)
        value = record.value if record.value is not None else b""
        verification = self.verifier.verify(purpose_of(record.key), record.topic, record.key, value, record.headers)
        if not verification.trusted:
            return _untrusted(verification, self.verifier.knows(verification.key_id))
        try:
            event = decode_control(value, max_bytes=self.max_bytes)
        except InvalidControl as bad:
            return Rejected(bad.reason, bad.message)
        except Exception as error:  # noqa: BLE001 - a decoder bug must not stop the reader
            log.exception("control.decode_crashed", offset=record.offset)
            return Rejected("decode_crashed", repr(error)[:1000])
        expected = control_key(event)
        if record.key != expected:
            return Rejected("wrong_key", f"record key {shown_key(record.key)!r} does not name what the command "
                                         f"changes; expected {expected!r}")
        return Command(event, verification.key_id or "", verification.stamp or 0)


def _untrusted(verification: Verification, key_known: bool) -> Rejected:
    if verification.verdict == "unsigned":
        return Rejected("unsigned", "not signed: commands must carry kev-key-id and kev-signature headers "
                                    "by a key in kafka.trust")
    if not key_known:
        return Rejected("unknown_key", f"signed by key {verification.key_id!r}, which is not in kafka.trust here "
                                       "(removed in a rotation? see kev control resign)", verification.key_id)
    return Rejected(verification.verdict, verification.reason, verification.key_id)  # forged | out_of_scope


DUPLICATE = "duplicate"  # Sequences.admit: the record applied last for its key, again


class Sequences:
    """The last applied command of each record key: its sequence number, value and record. A command is
    applied only when its number is above its key's last; the same number with the same value is the
    same command again (DUPLICATE). Cancels are not sequenced (they carry their signing time)."""

    def __init__(self) -> None:
        self.last: dict[bytes, tuple[Command, ConsumerRecord]] = {}

    def admit(self, record: ConsumerRecord, command: Command) -> Command | Rejected | str:
        if command.event.action == "cancel":
            return command
        key = record.key or b""
        if (last := self.last.get(key)) is not None and command.stamp <= last[0].stamp:
            applied, applied_record = last
            if command.stamp == applied.stamp and record.value == applied_record.value:
                return DUPLICATE
            return Rejected("stale_sequence", f"sequence {command.stamp} is not above {applied.stamp}, the last "
                                              f"applied for {shown_key(key)!r} (offset {applied_record.offset}): an "
                                              "older command published again, or a signer whose clock is behind",
                            command.key_id)
        self.last[key] = (command, record)
        return command

    def current(self, key: bytes | None) -> tuple[Command, ConsumerRecord] | None:
        """The command in force for `key` (the last applied) and its record, if any."""
        return self.last.get(key or b"")


def shown_key(key: bytes | None) -> bytes | None:
    return key[:100] if key is not None else None
