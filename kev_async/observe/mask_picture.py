"""A picture of one forward's attention visibility, drawn from its `forward.mask` audit record.

Layout: y is the query row in the packed batch (row 0 at the top); x is the key index, each question's
keys [0, kv_len) laid side by side in row order, so a correct forward is block-diagonal. Inside its
block a row at position p sees its question's keys 0..p: the keys cached by earlier forwards (light)
and the causal staircase over this forward's new keys (full colour). Everything else is blank, i.e.
invisible. Shared-prefix keys (`shared_prefix_len` in a segment) are hatched. Drawn as vector
shapes, so a forward of any size renders exactly, and with a cell grid when it is small.
"""

from __future__ import annotations

import logging
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from kev_async.observe.audit import check_log, format_report, read_audit_log
from schemas import DEFAULT_MODEL, Params, QuestionEvent

GRID_BELOW = 200  # draw every cell's grid line when both rows and keys are fewer than this
LABEL_EVERY_BELOW = 64  # label every key/row tick when the axis has fewer cells than this
LEGEND_DETAIL_UPTO = 12  # legend entries carry rows and positions up to this many questions
CACHED_ALPHA = 0.35  # the light tone of keys cached by earlier forwards


@dataclass
class Drawn:
    """What `render_forward` drew, for callers and tests."""

    path: Path
    segments: int
    rows: int
    keys: int
    width: int
    height: int
    legend: list[str] = field(default_factory=list)  # one label per question, then the key to the shading


@dataclass(frozen=True)
class _Block:
    qid: str
    row: int  # first row in the packed batch
    q_len: int  # rows this forward
    col: int  # first key column (the question's position 0)
    cached: int  # positions computed by earlier forwards (= positions[0])
    kv_len: int
    shared: int  # shared read-only prefix length


def _blocks(record: dict) -> list[_Block]:
    blocks, col = [], 0
    for seg in record["segments"]:
        (row_start, row_end), (pos_start, _pos_end) = seg["rows"], seg["positions"]
        blocks.append(_Block(str(seg["question_id"]), row_start, row_end - row_start, col, pos_start,
                             seg["kv_len"], int(seg.get("shared_prefix_len") or 0)))
        col += seg["kv_len"]
    return blocks


def _visible(b: _Block, left: float, right: float) -> list[tuple[float, float]]:
    """The polygon of cells row i (0-based) can see, keys [col, col + cached + i], clipped to [left, right]."""
    clip = lambda x: min(max(x, left), right)  # noqa: E731
    points = [(clip(b.col), b.row)]
    for i in range(b.q_len):
        edge = clip(b.col + b.cached + i + 1)
        points += [(edge, b.row + i), (edge, b.row + i + 1)]
    points.append((clip(b.col), b.row + b.q_len))
    return points


def render_forward(record: dict, output: Path | str, *, size_in: float = 8.0, dpi: int = 100,
                   title_prefix: str = "") -> Drawn:
    """Draw `record` (one forward.mask record) to a PNG of size_in x size_in inches at `dpi`."""
    # matplotlib is heavy: loaded when drawing, not by `kev audit check`
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Polygon, Rectangle

    blocks = _blocks(record)
    rows = max([record["tokens"]] + [b.row + b.q_len for b in blocks])
    keys = sum(b.kv_len for b in blocks)
    fig = Figure(figsize=(size_in, size_in), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)  # Agg, whatever pyplot's backend is; no global state touched
    ax = fig.add_subplot()
    colours = matplotlib.colormaps["tab10" if len(blocks) <= 10 else "tab20"]
    handles, legend = [], []
    for n, b in enumerate(blocks):
        colour = colours(n % colours.N)
        ax.add_patch(Polygon(_visible(b, b.col, b.col + b.kv_len), closed=True, facecolor=colour,
                             alpha=CACHED_ALPHA, edgecolor="none"))  # everything it sees, light
        if b.q_len:
            ax.add_patch(Polygon(_visible(b, b.col + b.cached, b.col + b.kv_len), closed=True,
                                 facecolor=colour, edgecolor="none"))  # this forward's new keys, full
        if b.shared:
            ax.add_patch(Polygon(_visible(b, b.col, b.col + b.shared), closed=True, facecolor="none",
                                 edgecolor="black", hatch="///", linewidth=0))
        ax.add_patch(Rectangle((b.col, b.row), b.kv_len, b.q_len, fill=False, edgecolor=colour,
                               linewidth=1.5))  # the question's block: nothing may show outside it
        kind = "decode" if b.q_len == 1 and b.cached else f"prefill {b.q_len}"
        label = f"{_short(b.qid)}: {kind}"
        if len(blocks) <= LEGEND_DETAIL_UPTO:
            label += (f", rows {b.row}–{b.row + b.q_len - 1}, pos {b.cached}–{b.kv_len - 1}"
                      + (f", shared {b.shared}" if b.shared else ""))
        handles.append(Patch(facecolor=colour, edgecolor=colour, label=label))
        legend.append(label)
        _label_block(ax, b, rows, keys)
    handles.append(Patch(facecolor="grey", alpha=CACHED_ALPHA, label="light: keys cached by earlier forwards"))
    handles.append(Patch(facecolor="grey", label="full: keys computed in this forward (causal)"))
    if any(b.shared for b in blocks):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="shared read-only prefix"))
    legend += [h.get_label() for h in handles[len(blocks):]]

    ax.set_xlim(0, max(keys, 1))
    ax.set_ylim(max(rows, 1), 0)  # row 0 at the top
    ax.set_facecolor("white")
    _ticks(ax, blocks, rows, keys)
    if rows < GRID_BELOW and keys < GRID_BELOW:
        ax.vlines(range(1, keys), 0, rows, colors="#d0d0d0", linewidth=0.3, zorder=0.5)
        ax.hlines(range(1, rows), 0, keys, colors="#d0d0d0", linewidth=0.3, zorder=0.5)
    ax.set_xlabel("key: its position in its question (questions side by side, in row order)")
    ax.set_ylabel("query row in the packed batch")
    ax.set_title(f"{title_prefix}forward {record['forward']}: {record['tokens']} tokens, {len(blocks)} questions, "
                 f"{keys} keys (block size {record.get('block_size', '?')})", fontsize=10)
    ncol = min(max(1, math.ceil(len(handles) / 8)), 2 if len(blocks) <= LEGEND_DETAIL_UPTO else 5)
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=7 if len(handles) <= 24 else 6,
               frameon=False)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=dpi, format="png")
    width, height = (round(v) for v in fig.get_size_inches() * dpi)
    return Drawn(output, len(blocks), rows, keys, width, height, legend)


def _label_block(ax, b: _Block, rows: int, keys: int) -> None:
    """The question id in its block's top-right corner (invisible keys), where the block is big enough."""
    text = _short(b.qid)
    plot_px = 560  # about the axes' side at 8 in x 100 dpi
    if b.q_len < 2 or b.kv_len / keys * plot_px < 7 * len(text) + 8 or b.q_len / rows * plot_px < 24:
        return
    ax.text(b.col + b.kv_len - 0.5, b.row + 0.5, text, ha="right", va="top", fontsize=9,
            clip_on=True, bbox=dict(boxstyle="round,pad=0.2", facecolor="white", alpha=0.8, linewidth=0))


def _short(qid: str, limit: int = 24) -> str:
    return qid if len(qid) <= limit else qid[: limit - 1] + "…"


def _thin(ticks: list[tuple[int, int]], span: int, slots: int = 40) -> list[tuple[int, int]]:
    """Drop ticks closer than span/slots to the previous one kept, so labels never pile up."""
    kept: list[tuple[int, int]] = []
    for tick in sorted(ticks):
        if not kept or tick[0] - kept[-1][0] >= span / slots:
            kept.append(tick)
    return kept


def _ticks(ax, blocks: list[_Block], rows: int, keys: int) -> None:
    """x ticks show each key's position inside its question, y ticks the packed row index."""
    if keys < LABEL_EVERY_BELOW:
        major = [(b.col + p, p) for b in blocks for p in range(b.kv_len)]
        minor = []
    else:  # each question's first new key and last key; its key 0 on a second line, so neighbours never collide
        major = _thin({(b.col + p, p) for b in blocks for p in (b.cached, b.kv_len - 1) if 0 < p < b.kv_len}, keys)
        minor = _thin({(b.col, 0) for b in blocks if b.kv_len} - set(major), keys)
    ax.set_xticks([x + 0.5 for x, _ in major], [str(p) for _, p in major], fontsize=6,
                  rotation=90 if keys < LABEL_EVERY_BELOW else 0)
    ax.set_xticks([x + 0.5 for x, _ in minor], [str(p) for _, p in minor], minor=True, fontsize=6)
    ax.tick_params(axis="x", which="minor", pad=9, length=8, color="#808080")
    if rows < LABEL_EVERY_BELOW:
        ys = list(range(rows))
    else:
        ys = [y for y, _ in _thin({(r, r) for b in blocks for r in (b.row, b.row + b.q_len - 1) if b.q_len}, rows)]
    ax.set_yticks([y + 0.5 for y in ys], [str(y) for y in ys], fontsize=6)
    ax.tick_params(length=2)
    for b in blocks[1:]:  # question boundaries on the key axis
        ax.axvline(b.col, color="#808080", linewidth=0.6, linestyle=":", zorder=0.6)


# -- docs/isolation.md's picture: `python -m kev_async.observe.mask_picture docs/mask.png` ---------
# (without a path it draws to .cache/mask.png, so a trial run leaves the tracked picture alone)

DEMO_QUESTIONS = ["Hi", "What is 2+2?", "Write a haiku about autumn leaves falling slowly.", "Name three primes."]


def record_demo_log(log_path: Path | str, model_name: str = DEFAULT_MODEL) -> None:
    """A real run with audit on, logged as structlog JSON lines: q0 and q1 start, q2 arrives at step 3 and
    q3 at step 4; a 32-token step budget chunks their prefills, so forward 5 packs two decodes, q2's
    second prefill chunk (keys cached by forward 4) and q3's first chunk."""
    # torch is heavy: the engine loads here, for this picture only, never for `kev audit`
    from engine import EngineCore, EngineOptions, load_model
    from engine.sampling_defaults import Defaults

    model = load_model(model_name, device="cpu", dtype="fp32")
    core = EngineCore(model, EngineOptions(audit=True, max_parallel_queries=8, max_tokens_per_step=32,
                                           batch_window_ms=0.0, defaults=Defaults()))
    arrivals = {0: [0, 1], 3: [2], 4: [3]}
    old = structlog.get_config()
    with open(log_path, "w") as file:
        structlog.configure(processors=[structlog.processors.add_log_level,
                                        structlog.processors.TimeStamper(fmt="iso", utc=True),
                                        structlog.processors.JSONRenderer()],
                            wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
                            logger_factory=structlog.WriteLoggerFactory(file), cache_logger_on_first_use=False)
        try:
            step = 0
            while core.has_work or step <= max(arrivals):
                for i in arrivals.get(step, []):
                    core.add(QuestionEvent(question_id=f"q{i}", prompt=DEMO_QUESTIONS[i],
                                           params=Params(max_new_tokens=8, temperature=0.0)))
                core.step()
                step += 1
        finally:
            structlog.configure(**old)


def _demo(argv: list[str] | None = None) -> int:
    output = Path((argv if argv is not None else sys.argv[1:] or [".cache/mask.png"])[0])
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "audit.log"
        record_demo_log(path)
        log = read_audit_log(path)
        report = check_log(log)
        print(format_report(str(path), log, report))
        if not report.clean:
            return 1
        record = log.find(5)[0]
        drawn = render_forward(record.data, output)
        print(f"wrote {output}: {record.label}, {drawn.segments} questions, {drawn.rows} rows x "
              f"{drawn.keys} keys, {drawn.width}x{drawn.height} px")
        return 0


if __name__ == "__main__":
    raise SystemExit(_demo())
