"""kev.yaml's `gateway` section: the OpenAI-compatible HTTP front door's address, keys and limits.

Part of the kev.yaml schema (schemas/config.py); every key defaulted.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from schemas.config_section import Positive, Section


class GatewayConfig(Section):
    """`kev gateway`: the OpenAI-compatible HTTP front door; it publishes questions and waits for answers."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000  # 0 = any free port
    # Gateway processes accepting on the one port. Each has its own event loop; at high concurrency a
    # request waits for the loop's work on the requests ahead of it, so more processes, less queueing.
    processes: Annotated[int, Meta(ge=1, le=64)] = 1
    served_model_name: str | None = None  # the model id clients name; None = the last part of core.model_path
    api_keys: dict[str, str] = {}  # API key -> tenant; empty (and no file) = no authentication
    api_keys_file: str | None = None  # a YAML mapping of API key -> tenant, read at start
    # Without API keys the gateway listens on the loopback only, unless this (or --allow-anonymous) says otherwise.
    allow_anonymous: bool = False
    audit_tenants: list[str] = []  # tenants whose responses carry the `x-kev-audit` header; never anonymous callers
    # Requests one tenant may have in flight (all anonymous callers together count as one), across every
    # process of `--processes N`; more get 429. A request holds its slot from its headers to its last byte.
    max_concurrent_per_tenant: Positive = 64
    # Queries one POST /v1/query may carry; each takes one of its tenant's slots (docs/gateway.md#post-v1query).
    max_queries_per_request: Positive = 64
    request_timeout_ms: Positive | None = None  # deadline of a request's question; None = aggregator.timeout_ms
    publish_timeout_ms: Positive = 3000  # the broker must ack a question within this, else 503
    # Limits on what a client may send before any work is done for it (docs/gateway.md#limits).
    max_connections: Positive = 1024  # open connections per gateway process; more are answered 503 and closed
    max_header_bytes: Positive = 16_384  # request line and headers together; more is 431 and the connection closed
    max_headers: Positive = 64  # header lines per request; more is 431
    header_read_timeout_ms: Positive = 30_000  # a request's headers must arrive within this, else 408
    # The body is read only after the tenant's slot is taken, within this (else 408) and up to max_body_bytes
    # (else 413); kafka.limits.max_event_bytes bounds what a question can carry anyway.
    body_read_timeout_ms: Positive = 30_000
    max_body_bytes: Positive = 1_000_000
    # Each write to a client must be taken within this; a client that stops reading is cut off, its
    # question cancelled and its slot freed.
    send_timeout_ms: Positive = 30_000
    max_prompt_chars: Positive = 200_000
    # The Batch API (docs/gateway.md#batch-api): where its files live (an S3-compatible store, s3://bucket/prefix,
    # endpoint and keys from AWS_* as the durable broker's; else a directory, None = "files" in Kev's cache
    # directory), the largest upload and the most requests per file, and how many lines of all batches are asked
    # at once.
    files_url: str | None = None
    files_dir: str | None = None
    max_file_bytes: Positive = 50_000_000
    max_batch_lines: Positive = 50_000
    batch_in_flight: Positive = 16
    run_batches: bool = True  # false: serve the batch routes but leave running batches to another gateway
