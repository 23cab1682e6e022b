"""`kev pipeline`: answer questions packed on the local model, and with --debug show how each forward kept
them apart: a mask summary and the token-level routing table per forward (seed 000's `kev pipeline --debug`),
checked by `kev audit check`'s own verifier, then the answers.

The tables are the engine's own audit records (`forward.mask`, engine/audit.py), caught from the log as the
engine writes them (nothing is recomputed here), so what is printed is what `kev audit check` would read.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import msgspec

from kev_async.drawing import matplotlib_missing
from kev_async.observe.audit import AUDIT_EVENTS, ENDING_EVENTS, AuditLog, ForwardRecord, check_log, format_report
from kev_async.cli._shared import bad_sampling, sampling_params
from kev_async.settings import load_config, set_threads
from schemas import DEFAULT_CONFIG, DEFAULT_MODEL, QuestionEvent

DESCRIPTION = """\
Answer each QUESTION with the model, all packed into shared forward passes (as `kev ask` does), and print
every answer. With --debug, first print for every forward:

  a mask summary: rows (tokens computed), questions, keys, the query-key pairs a row may attend against
    those of one dense mask over the packed rows, and the cross-question pairs, every one blocked (checked);
  the routing table, one line per question in the forward:
    #          the question's index on the command line (its id is q<#>)
    channel    the batch channel it holds (freed when it ends, reused by the next question)
    rows       its token rows in the packed forward (no two questions share a row)
    positions  its positions: they restart at 0 for every question
    blocks     its KV blocks; writes: the KV slots (block x block size + offset) its rows write
    sees       the KV slots its rows attend to: its own positions 0..kv-1 and nothing else

then the verdict of `kev audit check`'s verifier on those records (exit 1 on any violation).
Ranges are inclusive (3-7 = 3, 4, 5, 6, 7). --per-token adds one line per token row."""


def register(subparsers: argparse._SubParsersAction) -> None:
    pipeline = subparsers.add_parser(
        "pipeline", help="answer questions packed on the local model; --debug shows each forward's routing table",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    pipeline.add_argument("questions", nargs="+", metavar="QUESTION")
    pipeline.add_argument("--model", default=None, help="HF directory, .gguf file or built-in name "
                          f"(default: core.model_path, i.e. {DEFAULT_MODEL})")
    pipeline.add_argument("--config", default=None, help="a kev.yaml (default: built-in defaults + KEV_* env)")
    pipeline.add_argument("--max-new-tokens", type=int, default=None,
                          help="per answer (default: sampling.max_new_tokens)")
    pipeline.add_argument("--temperature", type=float, default=None,
                          help=f"0 = greedy (default: KEV_TEMPERATURE or {DEFAULT_CONFIG.sampling.temperature:g})")
    pipeline.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    pipeline.add_argument("--system", default=None, help="a system prompt for every question")
    pipeline.add_argument("--debug", action="store_true",
                          help="print each forward's mask summary and routing table before the answers")
    pipeline.add_argument("--per-token", action="store_true",
                          help="with --debug: also one line per token row (row, question, position, block, slot)")
    pipeline.add_argument("--picture", type=Path, default=None, metavar="PNG",
                          help="draw a forward's attention mask to this PNG (as `kev audit render` does)")
    pipeline.add_argument("--forward", type=int, default=None, metavar="N",
                          help="with --picture: the forward to draw (default: the first, a prefill)")
    pipeline.add_argument("--audit-log", type=Path, default=None, metavar="PATH",
                          help="write the forward records as JSON lines, for `kev audit check` / `kev audit render`")
    pipeline.set_defaults(func=_pipeline)


def _pipeline(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    params = sampling_params(args)
    problem = bad_sampling(params) or _bad_flags(args)  # before the model loads: a typo should not cost seconds
    if problem:
        print(f"kev pipeline: {problem}", file=sys.stderr)
        return 2
    if args.picture is not None and matplotlib_missing("kev pipeline", "leave out --picture"):
        return 2
    return _run(args, cfg, params)


def _bad_flags(args: argparse.Namespace) -> str | None:
    if args.forward is not None and args.picture is None:
        return "--forward picks the forward --picture draws; give --picture PNG too"
    if args.forward is not None and args.forward < 1:
        return f"--forward: forwards count from 1, got {args.forward}"
    if args.per_token and not args.debug:
        return "--per-token adds to --debug's tables; give --debug too"
    return None


def _run(args: argparse.Namespace, cfg, params: dict) -> int:
    # torch (the engine) and structlog are slow to import: loaded when the command runs, not for `kev --help`.
    from engine import EngineOptions, IsolatedBatchPipeline, load_model
    from kev_async.logs import configure_logging

    configure_logging(cfg.logging.level, cfg.logging.json)
    set_threads(cfg.core.threads)
    model = load_model(args.model or cfg.core.model_path, device=cfg.core.device, dtype=cfg.core.precision,
                       weights=cfg.core.weights, pack_fp32=cfg.core.pack_fp32, matmul=cfg.core.matmul)
    audit = bool(args.debug or args.picture or args.audit_log)
    options = EngineOptions.from_config(cfg, worker="kev-pipeline")
    pipe = IsolatedBatchPipeline(model, max_batch_size=options.max_parallel_queries, options=options,
                                 audit=audit or options.audit, debug=bool(args.per_token))
    questions = [QuestionEvent(question_id=f"q{i}", prompt=text, system=args.system)
                 for i, text in enumerate(args.questions)]
    with _recording(cfg.logging.level, pipe.core) as records:
        started = time.perf_counter()
        answers = pipe.run(questions, **params)
        elapsed = time.perf_counter() - started
    code = 0
    if args.debug:
        code = _print_forwards(records, pipe.core.block_size, per_token=args.per_token)
    _print_answers(questions, answers, elapsed)
    if args.audit_log:
        _write_log(args.audit_log, records)
    if args.picture:
        code = max(code, _draw(records, args.picture, args.forward))
    return code


# -- catching the engine's audit records -------------------------------------------------------------

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "exception": 40, "critical": 50}


@contextmanager
def _recording(level: str, core):
    """Inside: the engine's audit records (and its speculative endings) go to the yielded list instead of
    the log, each `forward.mask` with the channel of each of its questions; other lines log as configured."""
    import structlog

    before = structlog.get_config()
    records: list[dict] = []
    floor = _LEVELS[level.lower()]

    def keep(_logger, method: str, event: dict) -> dict:
        if event.get("event") in AUDIT_EVENTS + ENDING_EVENTS:
            records.append(_with_channels(dict(event), core))
            raise structlog.DropEvent
        if _LEVELS.get(method, floor) < floor:
            raise structlog.DropEvent
        return event

    # The records are logged at info: let info through the filter, and drop below the level in `keep`.
    structlog.configure(processors=[keep, *before["processors"]],
                        wrapper_class=structlog.make_filtering_bound_logger(min(floor, _LEVELS["info"])))
    try:
        yield records
    finally:
        structlog.configure(processors=before["processors"], wrapper_class=before["wrapper_class"])


def _with_channels(record: dict, core) -> dict:
    """The channel each segment's question holds now: the record is logged after the forward, before the
    step lets anyone go, so every question of the forward still holds the channel it ran in."""
    scheduler = core.scheduler
    channels = {seq.question_id: seq.channel for seq in scheduler.running + scheduler.lingering}
    for segment in record.get("segments") or ():
        segment["channel"] = channels.get(segment["question_id"])
    return record


def _audit_log(records: list[dict]) -> AuditLog:
    """The records as `kev audit check` reads them from a log file: one run, numbered as lines."""
    log = AuditLog(lines=len(records))
    for line, data in enumerate(records, 1):
        target = log.endings if data["event"] in ENDING_EVENTS else log.records
        target.append(ForwardRecord(1, line, data))
    return log


def _write_log(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(msgspec.json.encode(record) + b"\n" for record in records))
    print(f"wrote {path}: {len(records)} audit records (kev audit check {path})")


# -- printing ----------------------------------------------------------------------------------------

def _print_forwards(records: list[dict], block_size: int, *, per_token: bool) -> int:
    """Every forward's summary and table, then the verifier's verdict; 1 when it found a violation."""
    from engine.audit import routing_table, violations  # torch: loaded with the engine anyway

    log = _audit_log(records)
    for forward in log.records:
        print(_summary(forward.data, violations(forward.data)))
        print(_table(forward.data))
        if per_token:
            for row, qid, pos, block, offset in forward.data.get("routing") or routing_table(forward.data):
                print(f"      row {row:>4}  {qid}  pos {pos:>4}  block {block:>4}  slot {block * block_size + offset}")
        print()
    report = check_log(log)
    print(format_report("of this run", log, report) + "\n")
    return 0 if report.clean else 1


def _summary(record: dict, problems: list[str]) -> str:
    segments = record["segments"]
    rows, keys = record["tokens"], sum(s["kv_len"] for s in segments)
    visible = sum(_visible_pairs(s) for s in segments)
    cross = sum((s["rows"][1] - s["rows"][0]) * (keys - s["kv_len"]) for s in segments)
    dense = rows * keys
    decodes = sum(s["rows"][1] - s["rows"][0] == 1 and s["positions"][0] > 0 for s in segments)
    kinds = ", ".join(f"{n} {kind}" for n, kind in ((len(segments) - decodes, "prefill"), (decodes, "decode")) if n)
    head = (f"forward {record['forward']}: {rows} rows, {len(segments)} questions ({kinds}), {keys} keys; "
            f"visible pairs {visible} of {dense} in a dense mask ({100 * visible / max(dense, 1):.1f}%); ")
    if problems:
        return head + "ISOLATION VIOLATED:\n" + "\n".join(f"  ! {problem}" for problem in problems)
    return head + f"cross-question pairs {cross}, every one blocked"


def _visible_pairs(segment: dict) -> int:
    """Row i of a segment at position p sees its question's keys 0..p: (cached + 1) + ... + (cached + q)."""
    q, cached = segment["rows"][1] - segment["rows"][0], segment["positions"][0]
    return q * cached + q * (q + 1) // 2


TABLE_HEAD = ("#", "question", "channel", "rows", "positions", "kv", "blocks", "writes", "sees")


def _table(record: dict) -> str:
    size = record["block_size"]
    lines = [TABLE_HEAD]
    for seg in record["segments"]:
        (row0, row1), (pos0, pos1), qid = seg["rows"], seg["positions"], seg["question_id"]
        blocks = seg["blocks"]
        shared = int(seg.get("shared_prefix_len") or 0)
        lines.append((qid[1:] if qid[1:].isdigit() else "-", qid, _shown(seg.get("channel")), _span(row0, row1),
                      _span(pos0, pos1), str(seg["kv_len"]),
                      ",".join(map(str, blocks)) + (f" (first {shared} tokens: a read-only shared prefix)"
                                                    if shared else ""),
                      _ranges(_slots(blocks, size, pos0, pos1)), _ranges(_slots(blocks, size, 0, seg["kv_len"]))))
    widths = [max(len(line[i]) for line in lines) for i in range(len(TABLE_HEAD))]
    return "\n".join("  " + "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in lines)


def _slots(blocks: list[int], size: int, start: int, end: int) -> list[int]:
    return [blocks[pos // size] * size + pos % size for pos in range(start, end)]


def _span(start: int, end: int) -> str:
    return _ranges(list(range(start, end)))


def _ranges(values: list[int]) -> str:
    """3,4,5,9 -> "3-5,9"."""
    if not values:
        return "-"
    runs, first, last = [], values[0], values[0]
    for value in values[1:]:
        if value != last + 1:
            runs.append((first, last))
            first = value
        last = value
    runs.append((first, last))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _shown(value) -> str:
    return "-" if value is None else str(value)


def _print_answers(questions: list[QuestionEvent], answers, elapsed: float) -> None:
    for question, answer in zip(questions, answers):
        print(f"[{answer.question_id}] {question.prompt}")
        print(answer.text if not answer.error else f"error {answer.error.code}: {answer.error.message}")
        t, audit = answer.timings, answer.audit
        print(f"  finish={answer.finish_reason} tokens={answer.usage.prompt_tokens}+{answer.usage.completion_tokens}"
              f" channel={_shown(audit.channel)} forwards={audit.steps} ttft={t.ttft_ms}ms e2e={t.e2e_ms}ms\n")
    generated = sum(a.usage.completion_tokens for a in answers)
    print(f"{len(answers)} answers, {generated} tokens in {elapsed:.2f}s ({generated / elapsed:.1f} tokens/s)")


def _draw(records: list[dict], path: Path, forward: int | None) -> int:
    forwards = [r for r in records if r["event"] in AUDIT_EVENTS]
    chosen = [r for r in forwards if r["forward"] == forward] if forward is not None else forwards[:1]
    if not chosen:
        print(f"kev pipeline: --forward {forward}: this run had forwards 1..{len(forwards)}", file=sys.stderr)
        return 2
    from kev_async.observe.mask_picture import render_forward  # matplotlib: only when drawing

    drawn = render_forward(chosen[0], path)
    print(f"wrote {path}: forward {chosen[0]['forward']}, {drawn.segments} questions, {drawn.rows} rows x "
          f"{drawn.keys} keys, {drawn.width}x{drawn.height} px")
    return 0
