"""(c) Any OpenAI-compatible server (`--compare-url`), replaying the same trace over streaming HTTP.

`chat` posts `messages` to /v1/chat/completions (the server applies its own chat template);
`completions` posts the prompt as the token ids Kev itself feeds the model to /v1/completions, so a server
on the same weights sees exactly the same tokens. TTFT is the first chunk that carries text.
"""

from __future__ import annotations

import json
import time

import anyio
import httpx

from kev_async.bench.load.report import Outcome, SystemRun
from kev_async.bench.load.trace import TraceQuestion, prompt_ids


class CompareUrlError(RuntimeError):
    """The server behind --compare-url cannot be used; the message says why."""


def v1_base(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise CompareUrlError(f"--compare-url {url!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:8080")
    return url if url.endswith("/v1") else url + "/v1"


def probe(url: str) -> None:
    """Fail now, with the reason, if nothing answers at `url` (before minutes of the other systems)."""
    base = v1_base(url)
    try:
        httpx.get(f"{base}/models", timeout=10.0)
    except httpx.HTTPError as exc:
        raise CompareUrlError(f"--compare-url: cannot reach {base}/models: {exc!r}") from None


def run_openai(url: str, model, trace: list[TraceQuestion], *, api: str = "chat", served_model: str | None = None,
               extra_body: dict | None = None, api_key: str | None = None, timeout_s: float = 600.0,
               name: str | None = None) -> SystemRun:
    base = v1_base(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    outcomes = anyio.run(_trace, base, model, trace, api, served_model, extra_body or {}, headers, timeout_s)
    for o in outcomes:
        if o.completed and not o.tokens and o.text:  # no usage in the stream: count as Kev does, EOS included
            o.tokens = len(model.tokenizer.encode(o.text, add_special_tokens=False)) + (o.finish_reason == "stop")
    return SystemRun(name or f"openai-compatible {base}", outcomes, {"url": base, "api": api})


async def _trace(base, model, trace, api, served_model, extra_body, headers, timeout_s) -> list[Outcome]:
    # Open loop: no connection limit, so the client never queues a question the server should see.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits,
                                 headers=headers) as client:
        name = served_model or await _served_model(client, base)
        bodies = {q.qid: _body(q, model, api, name, extra_body) for q in trace}
        path = f"{base}/{'chat/completions' if api == 'chat' else 'completions'}"
        await _post(client, path, _body(trace[0], model, api, name, {**extra_body, "max_tokens": 2}), 0.0,
                    trace[0], check=True)  # warm-up, and a clear error now rather than N errors later
        done: dict[str, Outcome] = {}
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for q in trace:
                tg.start_soon(_question, client, path, bodies[q.qid], t0, q, done)
    return [done[q.qid] for q in trace]


async def _served_model(client, base: str) -> str:
    """The first model the server lists; servers that serve one model ignore the name anyway."""
    try:
        response = await client.get(f"{base}/models")
    except httpx.HTTPError as exc:
        raise CompareUrlError(f"--compare-url: cannot reach {base}/models: {exc!r}") from None
    if response.status_code != 200:
        return "default"
    data = response.json().get("data") or [{}]
    return data[0].get("id", "default")


def _body(q: TraceQuestion, model, api: str, name: str, extra_body: dict) -> dict:
    body = {"model": name, "max_tokens": q.max_new_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if api == "chat":
        messages = ([{"role": "system", "content": q.system}] if q.system else []) + [
            {"role": "user", "content": q.prompt}]
        body["messages"] = messages
    else:
        body["prompt"] = prompt_ids(model, q)
    return {**body, **extra_body}


async def _question(client, path: str, body: dict, t0: float, q: TraceQuestion, done: dict) -> None:
    await anyio.sleep_until(t0 + q.arrival_s)
    done[q.qid] = await _post(client, path, body, t0, q)


async def _post(client, path: str, body: dict, t0: float, q: TraceQuestion, check: bool = False) -> Outcome:
    outcome = Outcome(q.qid, q.arrival_s)
    pieces: list[str] = []
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                raise CompareUrlError(f"{path} answered HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                _read_chunk(json.loads(data), outcome, pieces, t0)
    except (httpx.HTTPError, CompareUrlError) as exc:
        if check:
            raise CompareUrlError(f"--compare-url: {exc!r}" if isinstance(exc, httpx.HTTPError) else str(exc)) from None
        outcome.error = repr(exc)[:300]
        return outcome
    outcome.finished_s = time.monotonic() - t0
    outcome.text = "".join(pieces)
    if outcome.first_token_s is None:
        outcome.first_token_s = outcome.finished_s
    return outcome


def _read_chunk(chunk: dict, outcome: Outcome, pieces: list[str], t0: float) -> None:
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if text:
            pieces.append(text)
            if outcome.first_token_s is None:
                outcome.first_token_s = time.monotonic() - t0
        if choice.get("finish_reason"):
            outcome.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        outcome.tokens = usage["completion_tokens"]
