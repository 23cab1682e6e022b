"""`kev bench engine`: Kev against transformers on the same model and questions, in one process.

(a) transformers `generate`, one question at a time   (b) transformers `generate`, one left-padded batch
(c) Kev, early eviction                                (d) Kev, finished questions kept until the batch drains
All greedy, all stopping at EOS or max_new_tokens. Prints tokens/s, the ratios, and whether (c)'s answers
are token-identical to (a)'s.

`kev bench lora`: the same questions with four adapters mixed in one batch, and with none.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from engine.bench_questions import QUESTIONS
from engine.options import EngineOptions
from engine.pipeline import IsolatedBatchPipeline
from engine.prompt import as_question, encode_prompt


@dataclass
class Run:
    name: str
    seconds: float
    tokens: int
    answers: list[list[int]]

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def run_kev(model, questions, max_new_tokens: int, early_stop: bool, repeats: int) -> Run:
    pipe = IsolatedBatchPipeline(model, max_batch_size=len(questions), early_stop=early_stop)
    pipe.run(questions[:2], max_new_tokens=2)  # warm-up: first-call allocations
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        answers = pipe.run(questions, max_new_tokens=max_new_tokens, temperature=0.0)
        runs.append((time.perf_counter() - started, answers))
    seconds, answers = sorted(runs, key=lambda r: r[0])[len(runs) // 2]  # the median run
    ids = [list(a.token_ids) for a in answers]
    name = "kev, early eviction" if early_stop else "kev, no early eviction"
    return Run(name, seconds, sum(map(len, ids)), ids)


def hf_model(model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model.path, dtype=model.dtype).eval()


def run_hf_sequential(hf, model, prompts: list[list[int]], max_new_tokens: int) -> Run:
    eos = list(model.spec.eos_token_ids)
    answers, started = [], time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0])
            answers.append(_trim(out[0, len(ids):].tolist(), eos))
    seconds = time.perf_counter() - started
    return Run("transformers, one at a time", seconds, sum(map(len, answers)), answers)


def run_hf_padded(hf, model, prompts: list[list[int]], max_new_tokens: int) -> Run:
    eos = list(model.spec.eos_token_ids)
    width = max(map(len, prompts))
    ids = torch.tensor([[eos[0]] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    started = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos[0])
    seconds = time.perf_counter() - started
    answers = [_trim(row[width:].tolist(), eos) for row in out]
    return Run("transformers, padded batch", seconds, sum(map(len, answers)), answers)


def _trim(tokens: list[int], eos: list[int]) -> list[int]:
    """Up to and including the first EOS, as Kev reports it; drop the padding after."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def bench_engine(model, *, num_questions: int = 32, max_new_tokens: int = 64, repeats: int = 3,
                 sequential: bool = True, out=print) -> dict:
    questions = [as_question(q, i) for i, q in enumerate((QUESTIONS * 8)[:num_questions])]
    prompts = [encode_prompt(model.tokenizer, q) for q in questions]
    hf = hf_model(model)
    runs = {}
    if sequential:
        runs["a"] = run_hf_sequential(hf, model, prompts, max_new_tokens)
    runs["b"] = run_hf_padded(hf, model, prompts, max_new_tokens)
    runs["c"] = run_kev(model, questions, max_new_tokens, early_stop=True, repeats=repeats)
    runs["d"] = run_kev(model, questions, max_new_tokens, early_stop=False, repeats=repeats)
    report(runs, model, num_questions, max_new_tokens, out)
    return runs


def report(runs: dict, model, num_questions: int, max_new_tokens: int, out=print) -> None:
    out(f"model {model.name} ({model.dtype}), {num_questions} questions, <= {max_new_tokens} new tokens, "
        f"greedy, torch threads {torch.get_num_threads()}")
    out(f"| run | engine | tokens | seconds | tokens/s |\n|---|---|---:|---:|---:|")
    for key, run in runs.items():
        out(f"| ({key}) | {run.name} | {run.tokens} | {run.seconds:.2f} | {run.rate:.1f} |")
    c = runs["c"]
    for key in ("a", "b", "d"):
        if key in runs:
            out(f"(c)/({key}) = {c.rate / runs[key].rate:.2f}x")
    reference = runs.get("a") or runs["b"]
    same = sum(x == y for x, y in zip(c.answers, reference.answers))
    out(f"(c) answers token-identical to ({'a' if 'a' in runs else 'b'}): {same}/{len(c.answers)}")
    if same < len(c.answers):
        first = [len(_common_prefix(x, y)) for x, y in zip(c.answers, reference.answers) if x != y]
        out(f"  differing answers agree on their first {statistics.median(first):.0f} tokens (median)")


def _common_prefix(x: list[int], y: list[int]) -> list[int]:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return x[:n]


# -- kev bench lora ----------------------------------------------------------------------------------

def write_random_adapter(directory: Path, model, rank: int, seed: int, b_std: float = 0.02) -> Path:
    """A PEFT-format LoRA adapter on every linear target, random A and small random non-zero B."""
    from safetensors.torch import save_file

    from engine.lora import TARGETS, target_shapes

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.spec.num_layers):
        for target, (features_in, features_out) in target_shapes(model.spec).items():
            block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, features_in, generator=generator) / features_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(features_out, rank, generator=generator) * b_std
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "use_rslora": False, "bias": "none",
              "target_modules": list(TARGETS), "base_model_name_or_path": model.name}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def bench_lora(model, *, num_questions: int = 32, max_new_tokens: int = 64, repeats: int = 3,
               num_adapters: int = 4, rank: int = 8, out=print) -> dict:
    """The same questions with no adapter and with `num_adapters` spread round-robin, in one engine.

    The two variants alternate within each repeat, so a noisy neighbour slows both alike; the median
    repeat of each is reported.
    """
    questions = [as_question(q, i) for i, q in enumerate((QUESTIONS * 8)[:num_questions])]
    pipe = IsolatedBatchPipeline(model, max_batch_size=num_questions,
                                 options=EngineOptions(max_loras=num_adapters))
    names = [f"adapter{i}" for i in range(num_adapters)]
    mixed = [msgspec.structs.replace(q, adapter=names[i % num_adapters]) for i, q in enumerate(questions)]
    variants = {"no adapter": questions, f"{num_adapters} adapters (r={rank}, all linear), round-robin": mixed}
    timings: dict[str, list] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:  # kept while serving: an evicted adapter is read back from it
        for i, name in enumerate(names):
            pipe.core.load_adapter(name, write_random_adapter(Path(tmp) / name, model, rank, seed=i))
        pipe.run(questions[:2], max_new_tokens=2)  # warm-up: first-call allocations
        pipe.run(mixed[:2], max_new_tokens=2)
        for _ in range(repeats):
            for name, batch in variants.items():
                started = time.perf_counter()
                answers = pipe.run(batch, max_new_tokens=max_new_tokens, temperature=0.0)
                timings[name].append((time.perf_counter() - started, answers))
    runs = {name: _median_run(name, samples) for name, samples in timings.items()}
    report_lora(runs, model, num_questions, max_new_tokens, repeats, out)
    return runs


def _median_run(name: str, samples: list) -> Run:
    seconds, answers = sorted(samples, key=lambda s: s[0])[len(samples) // 2]
    ids = [list(a.token_ids) for a in answers]
    return Run(name, seconds, sum(map(len, ids)), ids)


def report_lora(runs: dict, model, num_questions: int, max_new_tokens: int, repeats: int, out=print) -> None:
    out(f"model {model.name} ({model.dtype}), {num_questions} questions, <= {max_new_tokens} new tokens, "
        f"greedy, median of {repeats}, torch threads {torch.get_num_threads()}")
    out("| run | tokens | seconds | tokens/s |\n|---|---:|---:|---:|")
    for run in runs.values():
        out(f"| {run.name} | {run.tokens} | {run.seconds:.2f} | {run.rate:.1f} |")
    base, lora = runs.values()
    out(f"adapters / no adapter = {lora.rate / base.rate:.2f}x (target >= 0.70x)")


def bench_scaling(model, *, counts=(1, 2, 4, 8, 16, 32), max_new_tokens: int = 32, out=print) -> dict:
    """Tokens/s against the number of questions, for Kev and both transformers baselines."""
    hf = hf_model(model)
    rates: dict[str, list[float]] = {"kev": [], "transformers, one at a time": [], "transformers, padded batch": []}
    for count in counts:
        questions = [as_question(q, i) for i, q in enumerate((QUESTIONS * 8)[:count])]
        prompts = [encode_prompt(model.tokenizer, q) for q in questions]
        kev = run_kev(model, questions, max_new_tokens, early_stop=True, repeats=1)
        sequential = run_hf_sequential(hf, model, prompts, max_new_tokens)
        padded = run_hf_padded(hf, model, prompts, max_new_tokens)
        for name, run in zip(rates, (kev, sequential, padded)):
            rates[name].append(run.rate)
        out(f"{count:3} questions: kev {kev.rate:6.1f}  one-at-a-time {sequential.rate:6.1f}  "
            f"padded {padded.rate:6.1f} tokens/s")
    return {"counts": list(counts), "rates": rates, "max_new_tokens": max_new_tokens, "model": model.name}
