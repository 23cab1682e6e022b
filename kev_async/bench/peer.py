"""`kev bench peer`: one question alone, Kev in process against a running llama-server, side by side.

Two numbers a user choosing a CPU server compares: how fast one question decodes (ms per generated
token) and how fast one long prompt prefills (tokens/s), and the memory each process holds. Both sides get
the same prompt token ids and answer greedily; Kev runs in this process on the very GGUF file the server
loads (its quantized matrices kept as stored), or on the weights the server's GGUF was converted from.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from kev_async.bench.arguments import positive_int
from kev_async.bench.llama_server import LlamaServer, PeerError
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

Both sides get the prompt as the same token ids (llama-server's /completion; its /tokenize must make
those very ids of the prompts' text, or the run stops: it is serving another model), and the two alternate
within each repeat so a busy machine slows both alike. Kev's KV pool holds as many tokens as the server's
context (/props n_ctx). Printed: the medians of --repeats, each ratio as Kev's speed over llama.cpp's
(above 1: Kev is faster), the CPU, how many greedy tokens match before the answers part (quantized
weights: the two sides round differently), and each process's peak and current resident memory
(/proc/PID/status VmHWM and VmRSS; the server's when it listens on this host), Kev's split into its weights,
its KV pool and the rest.

Give --model the GGUF file the server runs, e.g.
  llama-server -m qwen2.5-coder-0.5b-instruct-q4_k_m.gguf -np 1 -c 4096 -t 2 --port 8081
  kev bench peer --url http://127.0.0.1:8081 --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --threads 2
or Kev's model directory with the server on its F32/BF16 conversion in the --dtype given here
(docs/speed.md, "The llama.cpp peer", says how to build llama-server and make the GGUF).
"""


def register(kinds: argparse._SubParsersAction) -> None:
    peer = kinds.add_parser("peer", help="one question's decode and one prompt's prefill, Kev against llama-server",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    peer.add_argument("--url", required=True, help="the running llama-server, e.g. http://127.0.0.1:8081")
    peer.add_argument("--model", default=DEFAULT_MODEL,
                      help="Kev's model: the .gguf file the server loads, or the weights its GGUF came from")
    peer.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                      help="Kev's compute precision; for a converted GGUF give the server that dtype (default fp32)")
    peer.add_argument("--weights", choices=("auto", "full", "int8"), default="auto",
                      help="Kev's weights: auto keeps a GGUF's block formats as stored (default auto)")
    peer.add_argument("--kv-dtype", choices=("auto", "compute", "fp16", "int8"), default="auto",
                      help="Kev's KV cache: auto is fp16 for a GGUF kept as stored under fp32 compute (llama-server's "
                           "default cache), else the compute dtype; compute: the compute dtype always (default auto)")
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
        model = load_model(args.model, device="cpu", dtype=args.dtype, weights=args.weights)
        bench_peer(model, server, info=info, repeats=args.repeats, new_tokens=args.new_tokens,
                   prompt_tokens=args.prompt_tokens, kv_dtype=args.kv_dtype)
    except (PeerError, ValueError) as exc:
        print(f"kev bench peer: error: {exc}", file=sys.stderr)
        return 2
    return 0


class KevSide:
    """One EngineCore holding one question at a time: EOS ignored, no prefix cache, no speculation, no
    batching window (nothing else could join anyway)."""

    def __init__(self, model, max_tokens: int, kv_tokens: int = 0, kv_dtype: str = "auto"):
        from engine import EngineOptions
        from engine.core import EngineCore
        from engine.kv.cache import cache_dtype

        kv_bytes = model.spec.kv_bytes_per_token(cache_dtype(kv_dtype, model))
        options = EngineOptions(max_parallel_queries=1, batch_window_ms=0, prefix_caching=False, speculative="off",
                                max_context=max_tokens + 16, kv_budget_bytes=max(kv_tokens, max_tokens + 64) * kv_bytes,
                                max_tokens_per_step=max(2048, max_tokens), kv_dtype=kv_dtype)
        self.core = EngineCore(model, options)
        self.kv_tokens = self.core.pool.num_blocks * self.core.block_size
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


def passages_text() -> str:
    return "\n\n".join(PASSAGES)


def prefill_prompts(model, tokens: int, count: int) -> list[list[int]]:
    """`count` prompts of exactly `tokens` token ids, each a different slice of the passages."""
    corpus = model.tokenizer.encode(passages_text(), add_special_tokens=False)
    ring = corpus * (2 + tokens // len(corpus))
    return [ring[(i * 173) % len(corpus):][:tokens] for i in range(count)]


def check_same_tokens(model, server: LlamaServer, short: list[int]) -> dict[str, int]:
    """The ids Kev sends must be the ids llama-server makes of the same text; a server whose tokenizer
    makes others is serving another model, and its speeds would not compare. Returns each text's length."""
    texts = {"the chat prompt": (model.tokenizer.decode(short, clean_up_tokenization_spaces=False), short),
             "the prefill passages": (passages_text(), model.tokenizer.encode(passages_text(),
                                                                               add_special_tokens=False))}
    for name, (text, ours) in texts.items():
        theirs = server.tokenize(text)
        if theirs != ours:
            at = _same_prefix(theirs, ours)
            raise PeerError(f"llama-server tokenizes {name} otherwise than Kev's tokenizer does (token {at} of "
                            f"{len(ours)}: kev {ours[at:at + 3]}, llama-server {theirs[at:at + 3]}): start it on "
                            "the same model as --model")
    return {name: len(ours) for name, (_, ours) in texts.items()}


def bench_peer(model, server: LlamaServer, *, info: dict | None = None, repeats: int = 5, new_tokens: int = 128,
               prompt_tokens: int = 1000, kv_dtype: str = "auto", out=print) -> dict:
    import torch

    from kev_async.bench.process_memory import resident_mib

    info = info or {}
    short = decode_prompt(model)
    long_prompts = prefill_prompts(model, prompt_tokens, repeats + 1)  # the first one warms up
    server_context = (info.get("default_generation_settings") or {}).get("n_ctx") or 0
    kev = KevSide(model, max(prompt_tokens + 1, len(short) + new_tokens), kv_tokens=server_context, kv_dtype=kv_dtype)
    for warm_up in (kev.decode, server.complete):  # first-call allocations, on both sides
        warm_up(short, 4)
    kev.prefill(long_prompts[0])
    server.complete(long_prompts[0], 1)
    checked = check_same_tokens(model, server, short)
    runs, tokens = _alternate(kev, server, short, long_prompts[1:], new_tokens)
    result = {name: statistics.median(values) for name, values in runs.items()}
    pid = server.local_pid()
    result.update(runs=runs, same=_same_prefix(tokens["kev"][0], tokens["llama"][0]), new_tokens=new_tokens,
                  steady=all(t == tokens[s][0] for s in tokens for t in tokens[s]), checked=checked,
                  kv_tokens=kev.kv_tokens, kv_dtype=str(kev.core.kv.k.dtype).removeprefix("torch."),
                  kev_memory=resident_mib(), llama_memory=pid and resident_mib(pid),
                  kev_parts={"weights": model.weights.nbytes / 2**20, "KV pool": kev.core.kv.nbytes / 2**20},
                  file_table=_file_table_mib(model))
    _report(model, info, result, repeats, prompt_tokens, torch.get_num_threads(), out)
    return result


def _alternate(kev: KevSide, server: LlamaServer, short: list[int], long_prompts: list[list[int]],
               new_tokens: int) -> tuple[dict, dict]:
    """One decode and one prefill per side per repeat, the side that goes first swapping every repeat."""
    runs = {"kev decode": [], "llama decode": [], "kev prefill": [], "llama prefill": []}
    tokens = {"kev": [], "llama": []}
    for r, long_prompt in enumerate(long_prompts):
        for side in (("kev", "llama") if r % 2 == 0 else ("llama", "kev")):
            if side == "kev":
                ms, ids = kev.decode(short, new_tokens)
                runs["kev prefill"].append(kev.prefill(long_prompt))
            else:
                ids, timings = server.complete(short, new_tokens)
                if timings["predicted_n"] < new_tokens:
                    raise PeerError(f"llama-server generated {timings['predicted_n']} of {new_tokens} tokens: "
                                    "give each slot room (start it with -np 1)")
                ms = timings["predicted_per_token_ms"]
                runs["llama prefill"].append(server.complete(long_prompt, 1)[1]["prompt_per_second"])
            runs[f"{side} decode"].append(ms)
            tokens[side].append(ids)
    return runs, tokens


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _report(model, info: dict, r: dict, repeats: int, prompt_tokens: int, threads: int, out) -> None:
    out(f"machine: {cpu_name()}")
    out(f"kev: {model.name} ({model.weight_format} weights, {model.dtype} compute), torch threads {threads}, "
        f"KV pool {r['kv_tokens']:,} tokens in {r['kv_dtype']}")
    out(f"llama.cpp: {info.get('model_path', '?')}, build {info.get('build_info', '?')}, "
        f"{info.get('total_slots', '?')} slot(s), context "
        f"{(info.get('default_generation_settings') or {}).get('n_ctx', '?')}, threads as its -t")
    decode_ratio, prefill_ratio = r["llama decode"] / r["kev decode"], r["kev prefill"] / r["llama prefill"]
    out("| metric | kev | llama.cpp | kev speed / llama.cpp | repeats |\n|---|---:|---:|---:|---:|")
    out(f"| decode, one question (ms/token) | {r['kev decode']:.2f} | {r['llama decode']:.2f} | "
        f"{decode_ratio:.2f}x | {repeats} |")
    out(f"| prefill, {prompt_tokens}-token prompt (tokens/s) | {r['kev prefill']:.0f} | {r['llama prefill']:.0f} | "
        f"{prefill_ratio:.2f}x | {repeats} |")
    for name, values in r["runs"].items():
        out(f"  {name} per repeat: " + ", ".join(f"{v:.2f}" if "decode" in name else f"{v:.0f}" for v in values))
    # On a busy host a repeat's two sides share its load; the medians above may come from different repeats.
    paired = {"decode": [llama / kev for kev, llama in zip(r["runs"]["kev decode"], r["runs"]["llama decode"])],
              "prefill": [kev / llama for kev, llama in zip(r["runs"]["kev prefill"], r["runs"]["llama prefill"])]}
    out("  kev speed / llama.cpp within each repeat: " + "; ".join(
        f"{name} {', '.join(f'{v:.2f}' for v in values)} (median {statistics.median(values):.2f}x)"
        for name, values in paired.items()))
    out("prompt token ids: llama-server's /tokenize makes Kev's ids of the same text ("
        + ", ".join(f"{name} {n} tokens" for name, n in r["checked"].items()) + ")")
    n = r["new_tokens"]
    verdict = "identical" if r["same"] == n else f"first {r['same']} identical, then they differ"
    out(f"greedy tokens, kev vs llama.cpp: {verdict} ({r['same']}/{n}); "
        f"every repeat the same answer on each side: {'yes' if r['steady'] else 'NO'}")
    out(_memory_line(r["kev_memory"], r["llama_memory"]))
    if r["kev_memory"]:  # where Kev's resident size goes: the weights and the pool exactly, the rest by difference
        parts = r["kev_parts"]
        rest = r["kev_memory"]["now"] - sum(parts.values())
        out("  kev now: " + ", ".join(f"{name} {mib:,.0f}" for name, mib in parts.items())
            + f" ({r['kv_dtype']}), the rest {rest:,.0f} (Python, torch, the tokenizer, step buffers)"
            + (f"; the embedding table ({r['file_table']:,.0f}) is read from the file by row, not held"
               if r.get("file_table") else ""))


def _file_table_mib(model) -> float:
    """MiB of an embedding table Kev leaves in its GGUF file (engine/model/gguf_weights.py FileTable), else 0."""
    from engine.model.gguf_weights import FileTable

    table = model.weights.embed
    return table.shape.numel() // table.format.block * table.format.bytes / 2**20 if isinstance(table, FileTable) else 0.0


def _memory_line(kev: dict | None, llama: dict | None) -> str:
    def side(m: dict | None) -> str:
        return f"peak {m['peak']:,.0f}, now {m['now']:,.0f}" if m else "not readable here"

    line = f"resident memory MiB (VmHWM peak, VmRSS now): kev {side(kev)}; llama-server {side(llama)}"
    if kev and llama:
        line += f"; kev / llama-server: peak {kev['peak'] / llama['peak']:.2f}x, now {kev['now'] / llama['now']:.2f}x"
    return line
