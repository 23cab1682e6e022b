"""What the gateway checks before it listens: who can reach it, and whether the workers will believe it.

- Beyond the loopback (any gateway.host but 127.0.0.0/8, ::1, localhost) it needs API keys, or an
  explicit gateway.allow_anonymous (`kev gateway --allow-anonymous`): an open gateway on 0.0.0.0 is
  an accident far more often than a choice.
- It needs a kafka.trust key to sign with. Workers honour a question's tenant, cache_salt and
  reply_topic only when it is signed: an unsigned gateway would get no answer back (its reply topic
  cleared), its tenants would be merged into one, and its anonymous callers would share one prefix
  cache. Refusing to start says so at once, instead of every request timing out.
- That key's scopes must be exactly what it signs, questions and cancel: a process that faces the
  internet must not hold a key the workers would obey as a command (load an adapter, change defaults).
"""

from __future__ import annotations

import ipaddress
import json
import secrets

import msgspec

from schemas import KevConfig
from schemas.kafka_config import TrustKey
from schemas.signing import CANCEL, CONTROL, QUESTION, Signer, TrustKeyError

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
GATEWAY_SCOPES = (QUESTION, CANCEL)


class GatewayRefused(ValueError):
    """The configuration would expose callers to each other or to anyone; the message says what to set."""


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def check_exposure(cfg: KevConfig, *, keys_configured: bool) -> Signer:
    """The signer for this gateway's records; GatewayRefused when it must not start as configured."""
    gateway = cfg.gateway
    local = is_loopback(gateway.host)
    if not local and not keys_configured and not gateway.allow_anonymous:
        raise GatewayRefused(
            f"refusing to listen on {gateway.host} without API keys: set gateway.api_keys (or api_keys_file), "
            "or pass --allow-anonymous (gateway.allow_anonymous: true) to serve anyone who can reach it")
    try:
        signer = Signer.from_config(cfg.kafka.trust)
    except TrustKeyError as error:
        raise GatewayRefused(str(error)) from None
    if signer is None:
        raise GatewayRefused(
            "kafka.trust.keys is empty: workers honour a question's reply_topic, tenant and cache_salt only when "
            "it is signed, so no answer would come back and callers would share one prefix cache; set "
            "kafka.trust.keys (and kafka.trust.sign_key if there are several) to the keys the workers have")
    return _scoped(signer)


def _scoped(signer: Signer) -> Signer:
    scopes = signer.key.scopes
    if CONTROL in scopes or not set(GATEWAY_SCOPES) <= scopes:
        raise GatewayRefused(
            f"kafka.trust: the gateway signs with key {signer.key_id!r}, whose scopes are {', '.join(sorted(scopes))}; "
            f"give it scopes [{', '.join(GATEWAY_SCOPES)}] exactly (`{signer.key_id}: {{secret: ..., scopes: "
            f"[{', '.join(GATEWAY_SCOPES)}]}}`, the same on the workers): it faces the internet, so it must not hold "
            "a key the workers obey as a control command")
    return signer


def with_session_trust_key(cfg: KevConfig) -> KevConfig:
    """`cfg` with a fresh kafka.trust key when none is configured: for a worker and gateway started together
    from one config (`kev demo --http`, `kev bench gateway`), so the gateway's questions are signed by a key
    the worker knows, and nobody else does."""
    trust = cfg.kafka.trust
    if trust.keys or trust.keys_file:
        return cfg
    session = TrustKey(secret=secrets.token_hex(32), scopes=GATEWAY_SCOPES)  # the gateway's scopes, no more
    trust = msgspec.structs.replace(trust, keys={"session": session}, sign_key="session")
    return msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, trust=trust))


def trust_env(cfg: KevConfig) -> dict[str, str]:
    """The KEV_* variables that hand cfg's trust keys to a `kev` child process."""
    trust = cfg.kafka.trust
    # JSON is YAML, as KEV_* values are read
    env = {"KEV_KAFKA__TRUST__KEYS": json.dumps(msgspec.to_builtins(trust.keys))}
    if trust.sign_key:
        env["KEV_KAFKA__TRUST__SIGN_KEY"] = trust.sign_key
    return env
