"""Record signatures, scheme v2: who may ask with server-side fields, cancel questions, or command the fleet.

A trusted producer signs each record with one of `kafka.trust.keys`; the signature and what a
verifier needs to check it travel as headers:

    signer = Signer.from_config(cfg.kafka.trust)
    headers = signer.headers(QUESTION, topic, key, value)          # stamped now
    verified = Verifier.from_config(cfg.kafka.trust).verify(QUESTION, record.topic, record.key,
                                                            record.value, record.headers)

What is signed binds the purpose (QUESTION, CANCEL, CONTROL), the topic, the record key, a stamp and
the value, so a signed record cannot be published again as another purpose, onto another topic, or
under another key (another partition, another command's key). The stamp is the signing time (ms since
the epoch, header `kev-signed-at`) of a question or cancel, and the sequence number (header
`kev-sequence`) of a command: `next_sequence()`, the time in ms, or one above the last this process
used if the clock has not moved. What is done with a stamp is the gates' policy: a question too old
is refused (consumers/intake/trust.py), a command whose number is not above the last applied for its key is
refused (consumers/control/reader.py).

Keys are HMAC-SHA256 secrets (whoever verifies can sign) or Ed25519 key pairs (a process given only
the public key verifies and cannot sign: `Signer.from_config` refuses). Each key has scopes, the
purposes it may sign; a Signer refuses to sign outside them, a Verifier to trust outside them. Which
algorithm checks a signature follows from the configured key, never from the record. A record is:

- signed: the signature verifies under the configured key it names, whose scopes hold the purpose;
- unsigned: it lacks kev-key-id or kev-signature;
- forged: its key id is not configured, its signature or stamp does not check out, or it was signed
  by another scheme (v1 signed the value alone: records signed so read as forged, with that reason);
- out_of_scope: the signature verifies but the key may not sign this (the gateway's key commanding
  the fleet).

Only "signed" is trusted; `Verification.reason` says why not, in words for a log line or an answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from schemas.kafka_config import ALL_TRUST_SCOPES, TrustConfig, TrustKey
from schemas.trust_keys import (MIN_SECRET_CHARS, Ed25519Key, HmacKey, Key, TrustKeyError, cannot_sign, make_key,
                                new_ed25519_pair, public_key_text, trust_keys)

# Re-exported: callers name the keys' types and errors beside the signer.
__all__ = ["CANCEL", "CONTROL", "MIN_SECRET_CHARS", "QUESTION", "Ed25519Key", "HmacKey", "Key", "Purpose", "Signer",
           "TrustKeyError", "Verification", "Verifier", "new_ed25519_pair", "next_sequence", "public_key_text",
           "signed_message"]

HEADER_KEY_ID = "kev-key-id"
HEADER_SIGNATURE = "kev-signature"
HEADER_VERSION = "kev-sig-v"
HEADER_SIGNED_AT = "kev-signed-at"
HEADER_SEQUENCE = "kev-sequence"
VERSION = b"2"
QUESTION, CANCEL, CONTROL = "questions", "cancel", "control"  # the purposes are the scopes that allow them
STAMP_HEADERS = {QUESTION: HEADER_SIGNED_AT, CANCEL: HEADER_SIGNED_AT, CONTROL: HEADER_SEQUENCE}
MAX_STAMP_DIGITS = 19  # below 2**63: what a Kafka timestamp holds

Purpose = Literal["questions", "cancel", "control"]
Headers = Iterable[tuple[str, bytes]]


def signed_message(purpose: Purpose, topic: str, key: bytes | None, stamp: int, value: bytes) -> bytes:
    """What a v2 signature covers: each part length-prefixed, so no two records share a message."""
    parts = [b"kev-sig-v2", purpose.encode(), topic.encode(), b"\x00" if key is None else b"\x01" + key,
             str(stamp).encode(), value]
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)


class _Sequence:
    """Sequence numbers for commands: the time in ms, kept strictly increasing within this process."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def next(self, above: int = 0) -> int:
        with self._lock:
            self._last = max(int(time.time() * 1000), self._last + 1, above + 1)
            return self._last


_SEQUENCE = _Sequence()


def next_sequence(above: int = 0) -> int:
    """A command's sequence number: now in ms, above every number this process handed out and above `above`.

    Above the last applied for its key as long as the signers' clocks move forward; `kev control resign`
    passes the number it replaces as `above`, so a clock behind the old signer's still moves on."""
    return _SEQUENCE.next(above)


class Signer:
    def __init__(self, key: Key) -> None:
        if not key.can_sign:
            raise TrustKeyError(cannot_sign(key.key_id))
        self.key = key

    @property
    def key_id(self) -> str:
        return self.key.key_id

    def __repr__(self) -> str:  # the key id only, never a secret
        return f"Signer(key_id={self.key_id!r}, scopes={sorted(self.key.scopes)!r})"

    @classmethod
    def hmac(cls, key_id: str, secret: str, scopes: Iterable[str] = ALL_TRUST_SCOPES) -> "Signer":
        return cls(make_key(key_id, TrustKey(secret=secret, scopes=tuple(scopes))))

    @classmethod
    def from_config(cls, cfg: TrustConfig) -> "Signer | None":
        """The signer `sign_key` names (or the only key that can sign); None when no key is configured.
        TrustKeyError when the key cannot sign (an Ed25519 public key only) or none is named among several."""
        keys = trust_keys(cfg)
        if not keys:
            return None
        if cfg.sign_key is not None:
            if cfg.sign_key not in keys:
                raise TrustKeyError(f"kafka.trust.sign_key: {cfg.sign_key!r} is not one of the configured keys")
            return cls(keys[cfg.sign_key])
        signing = [key for key in keys.values() if key.can_sign]
        if len(signing) > 1:
            raise TrustKeyError("kafka.trust.sign_key: several keys here can sign; name the one to sign with")
        if not signing:
            raise TrustKeyError("kafka.trust: every key here is an Ed25519 public key: this process verifies but "
                                "cannot sign (give the signer a private_key or secret)")
        return cls(signing[0])

    def headers(self, purpose: Purpose, topic: str, key: bytes | None, value: bytes,
                stamp: int | None = None) -> list[tuple[str, bytes]]:
        """The headers that sign `value` for `purpose` on `topic` under record key `key`. The stamp defaults
        to now (ms since the epoch) for a question or cancel, and to `next_sequence()` for a command."""
        if purpose not in self.key.scopes:
            raise TrustKeyError(f"key {self.key_id!r} may not sign {purpose} (its scopes: "
                                f"{', '.join(sorted(self.key.scopes))})")
        if stamp is None:
            stamp = next_sequence() if purpose == CONTROL else int(time.time() * 1000)
        signature = self.key.sign(signed_message(purpose, topic, key, stamp, value))
        return [(HEADER_KEY_ID, self.key_id.encode()), (HEADER_VERSION, VERSION),
                (STAMP_HEADERS[purpose], str(stamp).encode()), (HEADER_SIGNATURE, signature)]


Verdict = Literal["signed", "unsigned", "forged", "out_of_scope"]


@dataclass(frozen=True)
class Verification:
    verdict: Verdict
    key_id: str | None = None  # the key that signed it (signed, out_of_scope), or the id a forged record named
    stamp: int | None = None  # the signed stamp: signing time (questions, cancels) or sequence number (commands)
    reason: str = ""  # why it is not trusted, in words

    @property
    def trusted(self) -> bool:
        return self.verdict == "signed"


class Verifier:
    def __init__(self, keys: Mapping[str, Key]) -> None:
        self.keys = dict(keys)

    def __repr__(self) -> str:  # key ids only, never a secret
        return f"Verifier(key_ids={sorted(self.keys)!r})"

    @classmethod
    def from_config(cls, cfg: TrustConfig) -> "Verifier":
        return cls(trust_keys(cfg))

    def knows(self, key_id: str | None) -> bool:
        return key_id in self.keys

    def verify(self, purpose: Purpose, topic: str, key: bytes | None, value: bytes | None,
               headers: Headers) -> Verification:
        found = _signature_headers(headers, STAMP_HEADERS[purpose])
        if found.get(HEADER_KEY_ID) is None or found.get(HEADER_SIGNATURE) is None:
            return Verification("unsigned", reason="no kev-key-id and kev-signature headers")
        key_id = found[HEADER_KEY_ID][:64].decode("utf-8", "replace")
        if found.get(HEADER_VERSION) != VERSION:
            return Verification("forged", key_id, reason="not signed with scheme v2 (no kev-sig-v: 2 header; v1 "
                                                         "signed the value alone): sign it again")
        trust_key = self.keys.get(key_id)
        if trust_key is None:
            return Verification("forged", key_id, reason=f"key {key_id!r} is not configured here")
        stamp = _stamp(found.get(STAMP_HEADERS[purpose]))
        if stamp is None:
            return Verification("forged", key_id, reason=f"no usable {STAMP_HEADERS[purpose]} header for {purpose}")
        message = signed_message(purpose, topic, key, stamp, value or b"")
        if not trust_key.verify(message, found[HEADER_SIGNATURE]):
            return Verification("forged", key_id, stamp, f"the signature does not match key {key_id!r} (for "
                                                         f"{purpose} on {topic} under this record key)")
        if purpose not in trust_key.scopes:
            return Verification("out_of_scope", key_id, stamp, f"key {key_id!r} may not sign {purpose} (its scopes: "
                                                              f"{', '.join(sorted(trust_key.scopes))})")
        return Verification("signed", key_id, stamp)


def _signature_headers(headers: Headers, stamp_header: str) -> dict[str, bytes]:
    wanted = (HEADER_KEY_ID, HEADER_SIGNATURE, HEADER_VERSION, stamp_header)
    return {name: raw for name, raw in headers or () if name in wanted}


def _stamp(raw: bytes | None) -> int | None:
    if raw is None or not raw.isdigit() or len(raw) > MAX_STAMP_DIGITS:
        return None
    return int(raw)
