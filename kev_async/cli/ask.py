"""`kev ask`: the engine from the command line, no Kafka involved."""

from __future__ import annotations

import argparse
import sys
import time

from kev_async.cli._shared import bad_sampling, sampling_params
from kev_async.settings import load_config, set_threads
from schemas import DEFAULT_CONFIG, DEFAULT_MODEL, QuestionEvent


def register(subparsers: argparse._SubParsersAction) -> None:
    ask = subparsers.add_parser(
        "ask", help="answer questions on the local model, packed into one batch",
        description="Answer each QUESTION with the model, all packed into shared forward passes; "
                    "prints every answer with its finish reason, token counts and timings.")
    ask.add_argument("questions", nargs="+", metavar="QUESTION")
    ask.add_argument("--model", default=None, help="HF directory, .gguf file or built-in name "
                     f"(default: core.model_path, i.e. {DEFAULT_MODEL})")
    ask.add_argument("--config", default=None, help="a kev.yaml (default: built-in defaults + KEV_* env)")
    ask.add_argument("--max-new-tokens", type=int, default=None, help="per answer (default: sampling.max_new_tokens)")
    ask.add_argument("--temperature", type=float, default=None,
                     help=f"0 = greedy (default: KEV_TEMPERATURE or {DEFAULT_CONFIG.sampling.temperature:g})")
    ask.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    ask.add_argument("--system", default=None, help="a system prompt for every question")
    ask.set_defaults(func=_ask)


def _ask(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    params = sampling_params(args)
    problem = bad_sampling(params)  # before the model loads: a typo should not cost seconds
    if problem:
        print(f"kev ask: {problem}", file=sys.stderr)
        return 2
    return _answer(args, cfg, params)


def _answer(args: argparse.Namespace, cfg, params: dict) -> int:
    # torch (the engine) and structlog are slow to import: loaded when the command runs, not for `kev --help`.
    from engine import EngineOptions, IsolatedBatchPipeline, load_model
    from kev_async.logs import configure_logging

    configure_logging(cfg.logging.level, cfg.logging.json)
    set_threads(cfg.core.threads)
    model = load_model(args.model or cfg.core.model_path, device=cfg.core.device, dtype=cfg.core.precision,
                       weights=cfg.core.weights, pack_fp32=cfg.core.pack_fp32,
                    matmul=cfg.core.matmul)
    options = EngineOptions.from_config(cfg, worker="kev-ask")
    pipe = IsolatedBatchPipeline(model, max_batch_size=options.max_parallel_queries, options=options)
    questions = [QuestionEvent(question_id=f"q{i}", prompt=text, system=args.system)
                 for i, text in enumerate(args.questions)]
    prompts = {question.question_id: question.prompt for question in questions}
    started = time.perf_counter()
    answers = []
    for answer in pipe.as_completed(questions, **params):  # each as it finishes: short answers do not wait
        answers.append(answer)
        print(f"[{answer.question_id}] {prompts[answer.question_id]}")
        print(answer.text if not answer.error else f"error {answer.error.code}: {answer.error.message}")
        t = answer.timings
        print(f"  finish={answer.finish_reason} tokens={answer.usage.prompt_tokens}+{answer.usage.completion_tokens}"
              f" ttft={t.ttft_ms}ms e2e={t.e2e_ms}ms\n", flush=True)
    elapsed = time.perf_counter() - started
    generated = sum(a.usage.completion_tokens for a in answers)
    print(f"{len(answers)} answers, {generated} tokens in {elapsed:.2f}s ({generated / elapsed:.1f} tokens/s)")
    return 0
