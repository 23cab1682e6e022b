"""`kev ask` and `kev model prepare`: the engine from the command line, no Kafka involved."""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_ask(subparsers: argparse._SubParsersAction) -> None:
    ask = subparsers.add_parser(
        "ask", help="answer questions on the local model, packed into one batch",
        description="Answer each QUESTION with the model, all packed into shared forward passes; "
                    "prints every answer with its finish reason, token counts and timings.")
    ask.add_argument("questions", nargs="+", metavar="QUESTION")
    ask.add_argument("--model", default=None, help="HF directory, .gguf file or built-in name "
                     "(default: core.model_path, i.e. smollm2-135m-instruct)")
    ask.add_argument("--config", default=None, help="a kev.yaml (default: built-in defaults + KEV_* env)")
    ask.add_argument("--max-new-tokens", type=int, default=None, help="per answer (default: sampling.max_new_tokens)")
    ask.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: KEV_TEMPERATURE or 0)")
    ask.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    ask.add_argument("--system", default=None, help="a system prompt for every question")
    ask.set_defaults(func=_ask)


def add_model(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="prepare models", description="Prepare models for serving.")
    actions = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    prepare = actions.add_parser(
        "prepare", help="convert a GGUF (or the built-in model) once into the cache",
        description="Resolve MODEL and convert it to safetensors under KEV_CACHE_DIR if it is a GGUF; "
                    "later loads take about a second.")
    prepare.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    prepare.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from engine.loader import ModelNotFound, resolve_model_dir

    try:
        print(resolve_model_dir(args.model))
    except ModelNotFound as exc:
        print(f"kev model prepare: {exc}", file=sys.stderr)
        return 2
    return 0


def _ask(args: argparse.Namespace) -> int:
    from engine import EngineOptions, IsolatedBatchPipeline, load_model
    from kev_async.settings import load_config
    from schemas import QuestionEvent

    cfg = load_config(args.config)
    set_threads(cfg.core.threads)
    model = load_model(args.model or cfg.core.model_path, device=cfg.core.device, dtype=cfg.core.precision)
    options = EngineOptions.from_config(cfg, worker="kev-ask")
    pipe = IsolatedBatchPipeline(model, max_batch_size=options.max_batch_size, options=options)
    params = {k: v for k, v in (("max_new_tokens", args.max_new_tokens), ("temperature", args.temperature),
                                ("seed", args.seed)) if v is not None}
    questions = [QuestionEvent(question_id=f"q{i}", prompt=text, system=args.system)
                 for i, text in enumerate(args.questions)]
    started = time.perf_counter()
    answers = pipe.run(questions, **params)
    elapsed = time.perf_counter() - started
    for question, answer in zip(questions, answers):
        print(f"[{answer.question_id}] {question.prompt}")
        print(answer.text if not answer.error else f"error {answer.error.code}: {answer.error.message}")
        t = answer.timings
        print(f"  finish={answer.finish_reason} tokens={answer.usage.prompt_tokens}+{answer.usage.completion_tokens}"
              f" ttft={t.ttft_ms}ms e2e={t.e2e_ms}ms\n")
    generated = sum(a.usage.completion_tokens for a in answers)
    print(f"{len(answers)} answers, {generated} tokens in {elapsed:.2f}s ({generated / elapsed:.1f} tokens/s)")
    return 0


def set_threads(threads: int | None) -> None:
    """Torch's CPU threads for every command: as configured, else one per core (at most 16)."""
    import torch

    torch.set_num_threads(threads or min(os.cpu_count() or 1, 16))
