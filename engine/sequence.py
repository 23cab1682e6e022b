"""One question's life inside the engine: its tokens, its blocks, its status, who asked.

Neutral ground: the scheduler, the model runner and speculative decoding all read it, none owns it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

from schemas import DEFAULT_CONFIG
from schemas.principal import ANONYMOUS, Principal

_SAMPLING = DEFAULT_CONFIG.sampling


class Status(IntEnum):
    """Ordered so that `status >= Status.STOPPED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    STOPPED = 3
    LENGTH = 4
    TIMEOUT = 5
    CANCELLED = 6
    ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= Status.STOPPED

    @property
    def finish_reason(self) -> str:
        return _FINISH_REASONS[self]


_FINISH_REASONS = {
    Status.STOPPED: "stop",
    Status.LENGTH: "length",
    Status.TIMEOUT: "timeout",
    Status.CANCELLED: "cancelled",
    Status.ERROR: "error",
}


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved sampling settings: no field means "use a default" any more. The engine sets every
    field (engine/sampling_defaults.py); one built by hand gets kev.yaml's `sampling` defaults."""

    max_new_tokens: int = _SAMPLING.max_new_tokens
    temperature: float = _SAMPLING.temperature
    top_p: float = _SAMPLING.top_p
    top_k: int = _SAMPLING.top_k
    repetition_penalty: float = _SAMPLING.repetition_penalty
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    defaults_version: int = 0
    logprobs: int | None = None  # asked for logprobs: how many top alternatives per token; None: not asked
    logprobs_mode: str = "raw"  # "raw" (the model's own distribution) or "processed" (the one drawn from)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(eq=False)
class Sequence:
    """A question being answered. `num_computed_tokens` catches up with `num_tokens` each step."""

    question_id: str  # the engine's name for it: a question's sample i > 0 has its own (engine/samples.py)
    prompt_ids: list[int]
    params: SamplingParams
    sample: int = 0  # which of its question's params.n samples it draws
    channel: int = 0
    priority: int = 0
    deadline: float | None = None  # time.monotonic() value; None = no deadline
    adapter: str | None = None  # the adapter's name, as asked for
    lora: object | None = None  # the adapter version resolved at admission (engine.adapters.files.LoraAdapter)
    arrival: float = field(default_factory=time.monotonic)
    principal: Principal = ANONYMOUS  # who asked: its fair share and its tenant's quotas (engine/schedule/)
    output_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    error_code: str | None = None  # the error answer's code where it is not internal_error (an adapter's)
    routing_bucket: int | None = None
    normalized: bool = False  # router.normalize changed its user text (the answer's audit says so)
    audit_blocks: tuple[int, ...] = ()  # the blocks it held when it ended, for the answer's audit
    # The prefix cache (isolation.level: shared). No salt = this question neither reads nor fills it.
    cache_salt: bytes | None = None
    prefix_hashes: list[bytes] | None = None  # its full prompt blocks' hash chain, computed once
    num_registered: int = 0  # leading blocks named in the cache (a refused name stops the run)
    cached_prompt_tokens: int = 0  # prompt tokens read from the cache at its first admission
    overtaken: int = 0  # later questions admitted while it did not fit (bounded: no starvation)
    throttled_s: float = 0.0  # of its wait for the batch, the seconds its tenant was over a quota
    throttled_since: float | None = None  # over quota now, since then
    constraint: object | None = None  # its response_format's grammar state (engine.constrain.state.Constraint)
    ignored_fields: tuple[str, ...] = ()  # keys of the question Kev did not know, for the audit
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified for it
    accepted_draft_tokens: int = 0  # of those, the ones it emitted (the model agreed with them)
    # policy auto (engine/speculate/acceptance.py), fading: draft tokens after the first kept, and tried
    # (kept ones plus the first rejected one); per kind of draft, first tokens [kept, tried].
    draft_hits: float = 0.0
    draft_trials: float = 0.0
    first_draft_counts: dict[int, list[float]] = field(default_factory=dict)
    # The isolation audit (engine/audit.py): whether its rows' tokens are digested (it may draft), where its
    # current draft came from, and (drafted, accepted) of its last verified draft until its next forward.
    speculative: bool = False
    admitted_from: int = 0  # its first position at its latest admission: tokens before it came from the cache
    draft_origin: dict | None = None
    verified: tuple[int, int] | None = None
    logprobs: list | None = None  # params.logprobs asked: one engine.model.logprobs.Logprob per output token

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids) + list(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cache_namespace(self) -> tuple[str, int] | None:
        """(adapter, version) of the weights that computed this question's KV; None = the base model.

        Part of the prefix cache's salt (engine/kv/prefix_cache.py): a prefix computed under one adapter
        (or version) is never served to another.
        """
        return None if self.lora is None else self.lora.key

    @property
    def awaits_adapter(self) -> bool:
        """It names an adapter that no resident slot holds for it yet (adapters.max_resident, all in use)."""
        return self.adapter is not None and self.lora is None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def decoding(self) -> bool:
        """Its prompt (and any recompute) is done: each step computes its newest token and draws the next."""
        return self.num_uncomputed == 1 and self.num_computed_tokens >= self.num_prompt_tokens

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)
