"""A running llama-server (https://github.com/ggml-org/llama.cpp) as `kev bench peer` measures it: its own
endpoints, not the OpenAI ones, because only they take token ids, tokenize text and return `timings`."""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from kev_async.bench.process_memory import LOCAL_HOSTS, listening_pid

START_HINT = "llama-server -m MODEL.gguf -np 1 -t 2 --port 8081"


@dataclass(frozen=True)
class Response:
    status_code: int
    text: str

    def json(self):
        return json.loads(self.text)


class PeerError(RuntimeError):
    """The server at --url cannot be measured; the message says why."""


class LlamaServer:
    """/props for what it serves, /tokenize for its tokenizer, /completion for token-id prompts and `timings`."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        url = url.rstrip("/").removesuffix("/v1")
        if not url.startswith(("http://", "https://")):
            raise PeerError(f"--url {url!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:8081")
        self.url, self.timeout_s = url, timeout_s
        self._connection: http.client.HTTPConnection | None = None

    def props(self) -> dict:
        response = self._call("GET", "/props")
        return response.json() if response.status_code == 200 else {}

    def local_pid(self) -> int | None:
        """The server's process when it runs on this host (its memory is then readable), else None."""
        parts = urlsplit(self.url)
        if parts.hostname not in LOCAL_HOSTS:
            return None
        return listening_pid(parts.port or (443 if parts.scheme == "https" else 80))

    def tokenize(self, text: str) -> list[int]:
        """The server's token ids for `text`, special tokens in it parsed as such, none added."""
        response = self._call("POST", "/tokenize", payload={"content": text, "add_special": False,
                                                        "parse_special": True})
        tokens = _json(response, "/tokenize").get("tokens") if response.status_code == 200 else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise PeerError(f"{self.url}/tokenize answered HTTP {response.status_code} without a list of token ids: "
                            f"{response.text[:200]!r} (is it llama-server?)")
        return tokens

    def complete(self, prompt_ids: list[int], n_predict: int, *, ignore_eos: bool = True) -> tuple[list[int], dict]:
        """Greedy tokens and llama.cpp's `timings` for one token-id prompt, nothing reused from a cache."""
        body = {"prompt": prompt_ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "ignore_eos": ignore_eos, "return_tokens": True, "stream": False}
        response = self._call("POST", "/completion", payload=body)
        if response.status_code != 200:
            raise PeerError(f"{self.url}/completion answered HTTP {response.status_code}: {response.text[:300]!r} "
                            "(is it llama-server?)")
        data = _json(response, "/completion")
        timings = data.get("timings")
        wanted = ("prompt_n", "prompt_per_second", "predicted_n", "predicted_per_token_ms")
        if not isinstance(timings, dict) or any(key not in timings for key in wanted):
            raise PeerError(f"{self.url}/completion answered without llama-server's `timings` "
                            f"({', '.join(wanted)}): this benchmark needs llama-server")
        if timings["prompt_n"] < len(prompt_ids):
            raise PeerError(f"llama-server computed {timings['prompt_n']} of {len(prompt_ids)} prompt tokens "
                            "(it reused a cache): its prefill speed would be wrong")
        return list(data.get("tokens") or []), timings

    def _call(self, method: str, path: str, payload: dict | None = None) -> Response:
        """One request on a kept-alive connection (the standard library's: this client runs in the process
        whose memory the benchmark reports as Kev's, and httpx would add its CLI's rich and click to it)."""
        body = None if payload is None else json.dumps(payload).encode()
        for attempt in range(2):  # a kept-alive connection the server closed is opened again, once
            try:
                connection = self._connection or self._connect()
                connection.request(method, urlsplit(self.url).path + path, body=body,
                                   headers={"Content-Type": "application/json"} if body is not None else {})
                reply = connection.getresponse()
                return Response(reply.status, reply.read().decode("utf-8", "replace"))
            except (OSError, http.client.HTTPException) as exc:
                self._connection = None
                if attempt or isinstance(exc, (ConnectionRefusedError, TimeoutError)):
                    raise PeerError(f"cannot reach {self.url}{path}: {exc!r}; start llama-server first, e.g. "
                                    f"{START_HINT}") from None
        raise AssertionError("unreachable")

    def _connect(self) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._connection = kind(parts.hostname, parts.port, timeout=self.timeout_s)
        return self._connection


def _json(response: Response, path: str) -> dict:
    try:
        data = response.json()
    except ValueError:
        raise PeerError(f"{path} answered something that is not JSON: {response.text[:200]!r}") from None
    return data if isinstance(data, dict) else {}
