"""`kev bench peer`: one question alone, Kev in process against a running llama-server, side by side.

Two numbers a user choosing a CPU server compares: how fast one question decodes (ms per generated
token) and how fast one long prompt prefills (tokens/s). Both sides get the same prompt token ids and
answer greedily; Kev runs in this process on the same weights and dtype as the server's GGUF.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import httpx

from kev_async.bench.arguments import positive_int
from kev_async.bench.load.texts import PASSAGES
from kev_async.bench.machine import cpu_name
from kev_async.sample_questions import QUESTIONS
from schemas import DEFAULT_MODEL, Params, QuestionEvent

# torch and the engine are imported inside the functions that use them: `kev --help` imports this module.

DESCRIPTION = """\
One question alone, Kev against a running llama-server (https://github.com/ggml-org/llama.cpp), in one run:

  decode   one question's greedy answer of --new-tokens tokens after a short chat prompt, EOS ignored.
           Kev: the median time between two of its tokens (EngineCore steps, timed here).
           llama.cpp: its response's timings.predicted_per_token_ms (its own mean over the answer).
  prefill  one prompt of --prompt-tokens tokens (text cut from the load benchmark's passages, a different
           slice every repeat), one token asked for. Kev: prompt tokens / its time to first token
           (prefix cache off). llama.cpp: timings.prompt_per_second, sent with cache_prompt false.

Both sides get the prompt as the same token ids (llama-server's /completion), and the two alternate
within each repeat so a busy machine slows both alike. Printed: the medians of --repeats, each ratio
as Kev's speed over llama.cpp's (above 1: Kev is faster), the CPU, and whether the greedy tokens match.

Start the server on the GGUF converted from the same weights, in the dtype given to --dtype, e.g.
  llama-server -m smollm2-f32.gguf -np 1 -t 2 --port 8081
and give it --threads 2 here (docs/speed.md, "The llama.cpp peer", says how to build it and make the GGUF).
"""


class PeerError(RuntimeError):
    """The server at --url cannot be measured; the message says why."""


def register(kinds: argparse._SubParsersAction) -> None:
    peer = kinds.add_parser("peer", help="one question's decode and one prompt's prefill, Kev against llama-server",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    peer.add_argument("--url", required=True, help="the running llama-server, e.g. http://127.0.0.1:8081")
    peer.add_argument("--model", default=DEFAULT_MODEL, help="Kev's model: the weights the server's GGUF came from")
    peer.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                      help="Kev's precision; give the server the GGUF of the same (default fp32)")
    peer.add_argument("--threads", type=int, default=None,
                      help="Kev's torch threads; match the server's -t (default: all cores, at most 16)")
    peer.add_argument("--repeats", type=positive_int("repeats"), default=5, help="runs per side; medians (default 5)")
    peer.add_argument("--new-tokens", type=positive_int("new tokens"), default=128,
                      help="tokens of the decode answer (default 128)")
    peer.add_argument("--prompt-tokens", type=positive_int("prompt tokens"), default=1000,
                      help="tokens of the prefill prompt (default 1000)")
    peer.add_argument("--timeout", type=float, default=600.0, help="seconds one request to the server may take")
    peer.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from engine import load_model
    from kev_async.settings import set_threads

    try:
        server = LlamaServer(args.url, timeout_s=args.timeout)
        info = server.props()  # unreachable or not llama-server: say so before loading anything
        set_threads(args.threads)
        model = load_model(args.model, device="cpu", dtype=args.dtype)
        bench_peer(model, server, info=info, repeats=args.repeats, new_tokens=args.new_tokens,
                   prompt_tokens=args.prompt_tokens)
    except PeerError as exc:
        print(f"kev bench peer: error: {exc}", file=sys.stderr)
        return 2
    return 0


class LlamaServer:
    """llama-server's own endpoints: /props for what it serves, /completion for token-id prompts and `timings`."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        url = url.rstrip("/").removesuffix("/v1")
        if not url.startswith(("http://", "https://")):
            raise PeerError(f"--url {url!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:8081")
        self.url = url
        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))

    def props(self) -> dict:
        response = self._call("GET", "/props")
        return response.json() if response.status_code == 200 else {}

    def complete(self, prompt_ids: list[int], n_predict: int, *, ignore_eos: bool = True) -> tuple[list[int], dict]:
        """Greedy tokens and llama.cpp's `timings` for one token-id prompt, nothing reused from a cache."""
        body = {"prompt": prompt_ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "ignore_eos": ignore_eos, "return_tokens": True, "stream": False}
        response = self._call("POST", "/completion", json=body)
        if response.status_code != 200:
            raise PeerError(f"{self.url}/completion answered HTTP {response.status_code}: {response.text[:300]!r} "
                            "(is it llama-server?)")
        try:
            data = response.json()
        except ValueError:
            raise PeerError(f"{self.url}/completion answered something that is not JSON: {response.text[:200]!r}") \
                from None
        timings = data.get("timings") if isinstance(data, dict) else None
        wanted = ("prompt_n", "prompt_per_second", "predicted_n", "predicted_per_token_ms")
        if not isinstance(timings, dict) or any(key not in timings for key in wanted):
            raise PeerError(f"{self.url}/completion answered without llama-server's `timings` "
                            f"({', '.join(wanted)}): this benchmark needs llama-server")
        if timings["prompt_n"] < len(prompt_ids):
            raise PeerError(f"llama-server computed {timings['prompt_n']} of {len(prompt_ids)} prompt tokens "
                            "(it reused a cache): its prefill speed would be wrong")
        return list(data.get("tokens") or []), timings

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            return self.client.request(method, self.url + path, **kwargs)
        except httpx.HTTPError as exc:
            raise PeerError(f"cannot reach {self.url}{path}: {exc!r}; start llama-server first, e.g. "
                            "llama-server -m smollm2-f32.gguf -np 1 -t 2 --port 8081") from None


class KevSide:
    """One EngineCore holding one question at a time: EOS ignored, no prefix cache, no speculation, no
    batching window (nothing else could join anyway)."""

    def __init__(self, model, max_tokens: int):
        from engine import EngineOptions
        from engine.core import EngineCore
        from engine.kv.cache import cache_dtype

        kv_bytes = model.spec.kv_bytes_per_token(cache_dtype("auto", model.dtype))
        options = EngineOptions(max_parallel_queries=1, batch_window_ms=0, prefix_caching=False, speculative="off",
                                max_context=max_tokens + 16, kv_budget_bytes=(max_tokens + 64) * kv_bytes,
                                max_tokens_per_step=max(2048, max_tokens))
        self.core = EngineCore(model, options)
        self.core.stop_token_ids = ()  # the answer runs its whole budget, as llama-server's ignore_eos
        self.asked = 0

    def decode(self, prompt_ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        """Median ms between two generated tokens of one greedy answer, and its tokens."""
        seq = self._add(prompt_ids, new_tokens)
        gaps, last, count = [], None, 0
        while self.core.has_work:
            self.core.step()
            now = time.perf_counter()
            made = len(seq.output_ids) - count
            if made:
                if last is not None:
                    gaps.append((now - last) / made)
                last, count = now, len(seq.output_ids)
        return 1000 * statistics.median(gaps), list(seq.output_ids)

    def prefill(self, prompt_ids: list[int]) -> float:
        """Prompt tokens per second of time to first token: from add() to the step that samples it."""
        started = time.perf_counter()
        seq = self._add(prompt_ids, 1)
        while not seq.output_ids:
            self.core.step()
        seconds = time.perf_counter() - started
        while self.core.has_work:  # the answer's end, off the clock
            self.core.step()
        return len(prompt_ids) / seconds

    def _add(self, prompt_ids: list[int], max_new_tokens: int):
        self.asked += 1
        question = QuestionEvent(question_id=f"peer-{self.asked}", prompt="-",
                                 params=Params(max_new_tokens=max_new_tokens, temperature=0.0))
        return self.core.add(question, prompt_ids=prompt_ids)


def decode_prompt(model) -> list[int]:
    """A short chat prompt, as Kev's chat template encodes it."""
    from engine.prompt import encode_prompt

    return encode_prompt(model.tokenizer, QuestionEvent(question_id="peer-decode", prompt=QUESTIONS[0]))


def prefill_prompts(model, tokens: int, count: int) -> list[list[int]]:
    """`count` prompts of exactly `tokens` token ids, each a different slice of the passages."""
    corpus = model.tokenizer.encode("\n\n".join(PASSAGES), add_special_tokens=False)
    ring = corpus * (2 + tokens // len(corpus))
    return [ring[(i * 173) % len(corpus):][:tokens] for i in range(count)]


def bench_peer(model, server: LlamaServer, *, info: dict | None = None, repeats: int = 5, new_tokens: int = 128,
               prompt_tokens: int = 1000, out=print) -> dict:
    import torch

    short = decode_prompt(model)
    long_prompts = prefill_prompts(model, prompt_tokens, repeats + 1)  # the first one warms up
    kev = KevSide(model, max(prompt_tokens + 1, len(short) + new_tokens))
    for warm_up in (kev.decode, server.complete):  # first-call allocations, on both sides
        warm_up(short, 4)
    kev.prefill(long_prompts[0])
    server.complete(long_prompts[0], 1)
    runs = {"kev decode": [], "llama decode": [], "kev prefill": [], "llama prefill": []}
    tokens = {"kev": [], "llama": []}
    for r in range(repeats):
        for side in (("kev", "llama") if r % 2 == 0 else ("llama", "kev")):
            if side == "kev":
                ms, ids = kev.decode(short, new_tokens)
                runs["kev prefill"].append(kev.prefill(long_prompts[r + 1]))
            else:
                ids, timings = server.complete(short, new_tokens)
                if timings["predicted_n"] < new_tokens:
                    raise PeerError(f"llama-server generated {timings['predicted_n']} of {new_tokens} tokens: "
                                    "give each slot room (start it with -np 1)")
                ms = timings["predicted_per_token_ms"]
                runs["llama prefill"].append(server.complete(long_prompts[r + 1], 1)[1]["prompt_per_second"])
            runs[f"{side} decode"].append(ms)
            tokens[side].append(ids)
    result = {name: statistics.median(values) for name, values in runs.items()}
    result.update(runs=runs, same=_same_prefix(tokens["kev"][0], tokens["llama"][0]), new_tokens=new_tokens,
                  steady=all(t == tokens[s][0] for s in tokens for t in tokens[s]))
    _report(model, info or {}, result, repeats, prompt_tokens, torch.get_num_threads(), out)
    return result


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _report(model, info: dict, r: dict, repeats: int, prompt_tokens: int, threads: int, out) -> None:
    out(f"machine: {cpu_name()}")
    out(f"kev: {model.name} ({model.dtype}), torch threads {threads}")
    out(f"llama.cpp: {info.get('model_path', '?')}, build {info.get('build_info', '?')}, "
        f"{info.get('total_slots', '?')} slot(s), threads as its -t")
    decode_ratio, prefill_ratio = r["llama decode"] / r["kev decode"], r["kev prefill"] / r["llama prefill"]
    out("| metric | kev | llama.cpp | kev speed / llama.cpp | repeats |\n|---|---:|---:|---:|---:|")
    out(f"| decode, one question (ms/token) | {r['kev decode']:.2f} | {r['llama decode']:.2f} | "
        f"{decode_ratio:.2f}x | {repeats} |")
    out(f"| prefill, {prompt_tokens}-token prompt (tokens/s) | {r['kev prefill']:.0f} | {r['llama prefill']:.0f} | "
        f"{prefill_ratio:.2f}x | {repeats} |")
    for name, values in r["runs"].items():
        out(f"  {name} per repeat: " + ", ".join(f"{v:.2f}" if "decode" in name else f"{v:.0f}" for v in values))
    n = r["new_tokens"]
    verdict = "identical" if r["same"] == n else f"first {r['same']} identical, then they differ"
    out(f"greedy tokens, kev vs llama.cpp: {verdict} ({r['same']}/{n}); "
        f"every repeat the same answer on each side: {'yes' if r['steady'] else 'NO'}")
