"""The keys of `kafka.trust`: HMAC-SHA256 secrets and Ed25519 key pairs, each with the purposes (scopes)
it may sign, read from the config and an optional keys file, and checked once (length, encoding, that a
public key is its private key's)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from schemas.kafka_config import ALL_TRUST_SCOPES, TrustConfig, TrustKey

if TYPE_CHECKING:  # cryptography (~7 MiB resident) is imported where an Ed25519 key is first made or used
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

MIN_SECRET_CHARS = 16


class TrustKeyError(ValueError):
    """The configured keys cannot be used (a short secret, a bad key, an unreadable file, a sign_key that
    cannot sign), or a key was asked to sign outside its scopes."""


@dataclass(frozen=True)
class HmacKey:
    key_id: str
    scopes: frozenset[str]
    secret: bytes = field(repr=False)  # a log line or traceback showing the key never shows the secret
    can_sign = True

    def sign(self, message: bytes) -> bytes:
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest().encode()

    def verify(self, message: bytes, given: bytes) -> bool:
        return hmac.compare_digest(self.sign(message), given)


@dataclass(frozen=True)
class Ed25519Key:
    key_id: str
    scopes: frozenset[str]
    public: Ed25519PublicKey = field(repr=False)
    private: Ed25519PrivateKey | None = field(default=None, repr=False)

    @property
    def can_sign(self) -> bool:
        return self.private is not None

    def sign(self, message: bytes) -> bytes:
        if self.private is None:
            raise TrustKeyError(cannot_sign(self.key_id))
        return self.private.sign(message).hex().encode()

    def verify(self, message: bytes, given: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self.public.verify(bytes.fromhex(given.decode("ascii")), message)
        except (InvalidSignature, ValueError):  # not hex, not 64 bytes, or not this key's signature
            return False
        return True


Key = HmacKey | Ed25519Key


def cannot_sign(key_id: str) -> str:
    return (f"key {key_id!r} is an Ed25519 public key here: this process verifies with it but cannot sign "
            "(the signer needs its private_key)")


def trust_keys(cfg: TrustConfig) -> dict[str, Key]:
    """Key id -> key: `keys_file` (if any) overlaid by `keys`; each checked (length, encoding, pairs)."""
    given = {**_read_keys_file(cfg.keys_file), **cfg.keys} if cfg.keys_file else dict(cfg.keys)
    return {key_id: make_key(key_id, spec) for key_id, spec in given.items()}


def make_key(key_id: str, spec: str | TrustKey) -> Key:
    if not key_id or len(key_id) > 64:
        raise TrustKeyError(f"kafka.trust: key id {key_id[:70]!r} must have 1 to 64 characters")
    if isinstance(spec, str):
        spec = TrustKey(secret=spec)
    scopes = frozenset(spec.scopes)
    if not scopes:
        raise TrustKeyError(f"kafka.trust: key {key_id!r} has no scopes; give it some of {', '.join(ALL_TRUST_SCOPES)}")
    if spec.secret is not None:
        if spec.public_key or spec.private_key:
            raise TrustKeyError(f"kafka.trust: key {key_id!r} has a secret and an Ed25519 key; give it one kind")
        if len(spec.secret) < MIN_SECRET_CHARS:
            raise TrustKeyError(f"kafka.trust: the secret of key {key_id!r} has {len(spec.secret)} characters, "
                                f"at least {MIN_SECRET_CHARS} needed")
        return HmacKey(key_id, scopes, spec.secret.encode())
    return _ed25519_key(key_id, spec, scopes)


def _ed25519_key(key_id: str, spec: TrustKey, scopes: frozenset[str]) -> Ed25519Key:
    if spec.private_key is None and spec.public_key is None:
        raise TrustKeyError(f"kafka.trust: key {key_id!r} has neither a secret nor an Ed25519 public_key or "
                            "private_key")
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    private = None
    if spec.private_key is not None:
        private = Ed25519PrivateKey.from_private_bytes(_raw32(key_id, "private_key", spec.private_key))
    public = private.public_key() if private is not None else \
        Ed25519PublicKey.from_public_bytes(_raw32(key_id, "public_key", spec.public_key))
    if spec.public_key is not None and public_key_text(public) != spec.public_key:
        raise TrustKeyError(f"kafka.trust: key {key_id!r}: its public_key is not the private_key's")
    return Ed25519Key(key_id, scopes, public, private)


def _raw32(key_id: str, name: str, text: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise TrustKeyError(f"kafka.trust: key {key_id!r}: {name} must be the standard base64 of 32 bytes")
    return raw


def public_key_text(public: Ed25519PublicKey) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return base64.b64encode(public.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def new_ed25519_pair() -> tuple[str, str]:
    """A fresh (private_key, public_key), as kafka.trust.keys takes them."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    seed = private.private_bytes_raw()
    return base64.b64encode(seed).decode(), public_key_text(private.public_key())


def _read_keys_file(path: str) -> dict[str, str | TrustKey]:
    try:
        data = msgspec.yaml.decode(Path(path).read_bytes(), type=dict[str, str | TrustKey])
    except OSError as error:
        raise TrustKeyError(f"kafka.trust.keys_file {path}: cannot read: {error.strerror or error}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise TrustKeyError(f"kafka.trust.keys_file {path}: expected a mapping of key id -> secret or "
                            f"{{secret | public_key | private_key, scopes}}: {error}") from None
    return data
