"""API keys -> tenants. The tenant of a question comes from the credential that sent it, never from its body.

Keys are kept only as SHA-256 digests and every stored digest is compared (hmac.compare_digest) on
each check, so neither the comparison nor where a match sits in the table shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import yaml

from kev_async.gateway.errors import ApiError
from schemas import GatewayConfig


class Authenticator:
    def __init__(self, keys: dict[str, str]) -> None:
        self._digests = [(_digest(key), tenant) for key, tenant in keys.items()]

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> "Authenticator":
        return cls({**read_keys_file(cfg.api_keys_file), **cfg.api_keys})

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def tenants(self) -> set[str]:
        return {tenant for _, tenant in self._digests}

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer KEY` header; None when keys are off; else 401."""
        if not self.enabled:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
                           code="invalid_api_key")
        digest = _digest(key.strip())
        found = None
        for known, tenant in self._digests:  # no early exit: every key costs the same
            if hmac.compare_digest(known, digest):
                found = tenant
        if found is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return found


def read_keys_file(path: str | None) -> dict[str, str]:
    """A YAML mapping of key -> tenant; a missing or malformed file fails the start, naming it."""
    if path is None:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"gateway.api_keys_file {path}: cannot read: {error}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"gateway.api_keys_file {path}: expected a mapping of API key -> tenant (strings)")
    return data


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
