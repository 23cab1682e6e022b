"""`kev demo --http`: after the Kafka demo, the gateway on the demo's broker, one request through it
exactly as the printed `curl` line sends it, then serving until Ctrl-C."""

from __future__ import annotations

import json
import shlex
from functools import partial
from typing import Any

import anyio
import httpx
import msgspec

from kev_async.gateway.server import run_gateway
from schemas import KevConfig

QUESTION = "Why is the sky blue? Answer in one sentence."


async def demo_over_http(cfg: KevConfig, bootstrap_servers: str, shutdown: Any, *, max_new_tokens: int,
                         out=print) -> None:
    cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, bootstrap_servers=bootstrap_servers))
    async with anyio.create_task_group() as tg:
        running = await tg.start(partial(run_gateway, cfg, shutdown))
        url = f"{running.url}/v1/chat/completions"
        body = {"model": running.model, "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": max_new_tokens}
        headers = {"content-type": "application/json"}
        if cfg.gateway.api_keys or cfg.gateway.api_keys_file:
            headers["authorization"] = "Bearer $KEV_API_KEY"  # the demo never prints a key
        out(f"\nkev: OpenAI-compatible gateway on {running.url}/v1 (model {running.model!r}); try:\n")
        out(curl_line(url, headers, body) + "\n")
        if "authorization" not in headers:
            async with httpx.AsyncClient(timeout=120) as client:
                answer = (await client.post(url, json=body)).json()
            out(f"[http] {_summary(answer)}")
        out("\nkev: serving until Ctrl-C")


def curl_line(url: str, headers: dict[str, str], body: dict) -> str:
    parts = ["curl", "-s", shlex.quote(url)]
    for name, value in headers.items():
        header = f"{name}: {value}"
        parts += ["-H", f'"{header}"' if "$" in value else shlex.quote(header)]  # let the shell expand $VAR
    parts += ["-d", shlex.quote(json.dumps(body))]
    return " ".join(parts)


def _summary(answer: dict) -> str:
    if "error" in answer:
        return f"error {answer['error'].get('code')}: {answer['error'].get('message')}"
    choice, usage = answer["choices"][0], answer["usage"]
    text = choice["message"]["content"].replace("\n", " ")
    return f"{choice['finish_reason']} {usage['completion_tokens']} tokens  {text[:120]}"
