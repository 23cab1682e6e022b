"""Record signatures: who may set server-side fields or command the fleet (the trust boundary).

A trusted producer (the gateway, an operator's tool) signs each record's value with HMAC-SHA256
under a shared key and sends the key's id and the signature as headers:

    headers = Signer.from_config(cfg.kafka.trust).headers(value, QUESTION)
    verified = Verifier.from_config(cfg.kafka.trust).verify(value, record.headers, QUESTION)

The purpose (`QUESTION` or `CONTROL`) is part of what is signed, so a signed question can never be
replayed as a command. A record without both headers is unsigned; one whose signature does not
match any configured key is forged, and counts as unsigned too (the outcome names which).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from schemas.config import TrustConfig

HEADER_KEY_ID = "kev-key-id"
HEADER_SIGNATURE = "kev-signature"
QUESTION = b"kev.question.v1"
CONTROL = b"kev.control.v1"
MIN_SECRET_CHARS = 16

Purpose = bytes
Headers = Iterable[tuple[str, bytes]]


class TrustKeyError(ValueError):
    """The configured keys cannot be used (a short secret, an unreadable file, an unknown sign_key)."""


def signature(secret: str, value: bytes, purpose: Purpose) -> str:
    return hmac.new(secret.encode(), purpose + b"\n" + value, hashlib.sha256).hexdigest()


def trust_keys(cfg: TrustConfig) -> dict[str, str]:
    """Key id -> secret: `keys_file` (if any) overlaid by `keys`; every secret checked for length."""
    keys = {**_read_keys_file(cfg.keys_file), **cfg.keys} if cfg.keys_file else dict(cfg.keys)
    for key_id, secret in keys.items():
        if not key_id or len(key_id) > 64:
            raise TrustKeyError(f"kafka.trust: key id {key_id[:70]!r} must have 1 to 64 characters")
        if len(secret) < MIN_SECRET_CHARS:
            raise TrustKeyError(f"kafka.trust: the secret of key {key_id!r} has {len(secret)} characters, "
                                f"at least {MIN_SECRET_CHARS} needed")
    return keys


def _read_keys_file(path: str) -> dict[str, str]:
    try:
        data = msgspec.yaml.decode(Path(path).read_bytes(), type=dict[str, str])
    except OSError as error:
        raise TrustKeyError(f"kafka.trust.keys_file {path}: cannot read: {error.strerror or error}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise TrustKeyError(f"kafka.trust.keys_file {path}: expected a mapping of key id -> secret "
                            f"(strings): {error}") from None
    return data


@dataclass(frozen=True)
class Signer:
    key_id: str
    secret: str = field(repr=False)  # a log line or traceback showing the signer never shows the secret

    @classmethod
    def from_config(cls, cfg: TrustConfig) -> "Signer | None":
        """The signer `sign_key` names (or the only key); None when no key is configured."""
        keys = trust_keys(cfg)
        if not keys:
            return None
        if cfg.sign_key is None:
            if len(keys) > 1:
                raise TrustKeyError("kafka.trust.sign_key: several keys are configured; name the one to sign with")
            return cls(*next(iter(keys.items())))
        if cfg.sign_key not in keys:
            raise TrustKeyError(f"kafka.trust.sign_key: {cfg.sign_key!r} is not one of the configured keys")
        return cls(cfg.sign_key, keys[cfg.sign_key])

    def headers(self, value: bytes, purpose: Purpose) -> list[tuple[str, bytes]]:
        return [(HEADER_KEY_ID, self.key_id.encode()),
                (HEADER_SIGNATURE, signature(self.secret, value, purpose).encode())]


Verdict = Literal["signed", "unsigned", "forged"]


@dataclass(frozen=True)
class Verification:
    verdict: Verdict
    key_id: str | None = None  # the key that signed it (signed), or the id a forged record named

    @property
    def trusted(self) -> bool:
        return self.verdict == "signed"


class Verifier:
    def __init__(self, keys: Mapping[str, str]) -> None:
        self.keys = dict(keys)

    def __repr__(self) -> str:  # key ids only, never a secret
        return f"Verifier(key_ids={sorted(self.keys)!r})"

    @classmethod
    def from_config(cls, cfg: TrustConfig) -> "Verifier":
        return cls(trust_keys(cfg))

    def verify(self, value: bytes | None, headers: Headers, purpose: Purpose) -> Verification:
        key_id = given = None
        for name, raw in headers or ():
            if name == HEADER_KEY_ID:
                key_id = raw
            elif name == HEADER_SIGNATURE:
                given = raw
        if key_id is None or given is None:
            return Verification("unsigned")
        shown = key_id[:64].decode("utf-8", "replace")
        secret = self.keys.get(key_id.decode("utf-8", "replace"))
        if secret is None:
            return Verification("forged", shown)
        expected = signature(secret, value or b"", purpose).encode()
        return Verification("signed", shown) if hmac.compare_digest(expected, given) else Verification("forged", shown)
