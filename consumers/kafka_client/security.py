"""kev.yaml's kafka.security as keyword arguments for aiokafka's clients (consumer, producer, admin)."""

from __future__ import annotations

from typing import Any

from aiokafka.helpers import create_ssl_context

from schemas import SecurityConfig


def client_options(security: SecurityConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"security_protocol": security.security_protocol}
    if security.security_protocol.startswith("SASL"):
        options["sasl_mechanism"] = security.sasl_mechanism or "PLAIN"
        options["sasl_plain_username"] = security.sasl_plain_username
        options["sasl_plain_password"] = security.sasl_plain_password
    if security.security_protocol.endswith("SSL"):
        options["ssl_context"] = create_ssl_context(
            cafile=security.ssl_cafile, certfile=security.ssl_certfile, keyfile=security.ssl_keyfile
        )
    return options
