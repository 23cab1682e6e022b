"""Compiled grammars: one per distinct response_format, kept in a bounded LRU per engine (per tokenizer).

A compiled grammar is an llguidance matcher at its start state, with the first mask already computed:
that first mask finishes llguidance's lazy build, and it is the first mask of every question that
asks for this format. A question gets a copy of the matcher (tens of microseconds). Compiling drops the
GIL; `Engine` compiles on its compile threads (engine/compile_threads.py), so a new schema never holds
up a step, and a question whose grammar is compiling waits alone. Formats that fail to compile are kept
too, with their reason, so a flood of one bad schema is compiled once.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import structlog
import torch

from schemas.constraint import ConstraintSpec, InvalidConstraint

log = structlog.get_logger("kev.structured")
# HF tokenizer -> {EOS id -> LLTokenizer}: the view carries its EOS, and two models may share a tokenizer
# object with different EOS ids (a view built for one would let the other's answers stop at the wrong token).
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


@dataclass(frozen=True)
class CompiledGrammar:
    spec: ConstraintSpec
    matcher: llguidance.LLMatcher  # at the start state; only ever copied, never advanced
    first_mask: torch.Tensor  # int32 words, one bit per token: what may come first


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    failed: int = 0  # formats that did not compile (each counted once while it stays cached)


def llg_tokenizer(tokenizer, eos_token_id: int) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer with that EOS; built once per pair (~0.5 s for 49k
    tokens)."""
    with _TOKENIZERS_LOCK:
        views = _TOKENIZERS.setdefault(tokenizer, {})
        built = views.get(eos_token_id)
        if built is None:
            started = time.perf_counter()
            backend = tokenizer.backend_tokenizer
            built = llguidance.LLTokenizer(backend.to_str(), n_vocab=len(tokenizer), eos_token=eos_token_id)
            views[eos_token_id] = built
            log.info("structured.tokenizer", vocab=built.vocab_size, ms=round((time.perf_counter() - started) * 1e3, 1))
        return built


class GrammarCache:
    """Thread-safe: compiled on the compile threads, read on the device thread. Two threads asking for
    one new format at once compile it once."""

    def __init__(self, tokenizer, eos_token_id: int, capacity: int):
        self._hf_tokenizer = tokenizer
        self._eos = eos_token_id
        self.capacity = capacity
        self.stats = GrammarStats()
        self._entries: OrderedDict[str, CompiledGrammar | InvalidConstraint] = OrderedDict()
        self._compiling: dict[str, threading.Event] = {}  # digest -> set once its compile is kept
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:  # built at the first structured question: engines without any never pay
            self._tokenizer = llg_tokenizer(self._hf_tokenizer, self._eos)
        return self._tokenizer

    @property
    def mask_words(self) -> int:
        return (self.tokenizer.vocab_size + 31) // 32

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, spec: ConstraintSpec) -> CompiledGrammar:
        """The compiled grammar of `spec`, compiled now on a miss; raises InvalidConstraint."""
        entry = None
        while entry is None:
            with self._lock:
                entry = self._entries.get(spec.digest)
                if entry is not None:
                    self._entries.move_to_end(spec.digest)
                    self.stats.cache_hits += 1
                    break
                compiling = self._compiling.get(spec.digest)
                mine = compiling is None
                if mine:
                    compiling = self._compiling[spec.digest] = threading.Event()
            if not mine:  # another thread compiles this very format: wait for it, not a second compile
                compiling.wait()
                continue
            try:
                entry = self._compile(spec)  # outside the lock: another thread's hit never waits on a compile
                self._keep(spec.digest, entry)
            finally:
                with self._lock:
                    del self._compiling[spec.digest]
                compiling.set()
        if isinstance(entry, InvalidConstraint):
            raise entry
        return entry

    def _compile(self, spec: ConstraintSpec) -> CompiledGrammar | InvalidConstraint:
        tokenizer = self.tokenizer  # built once, before the clock: it is not this grammar's compile time
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, spec.grammar, log_level=0)
        first = torch.zeros(self.mask_words, dtype=torch.int32)
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(first.data_ptr(), first.numel() * 4)
        seconds = time.perf_counter() - started
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += seconds
        if matcher.is_error():
            self.stats.failed += 1
            return InvalidConstraint(spec.where, matcher.get_error())
        log.info("structured.compiled", constraint=spec.label, ms=round(seconds * 1e3, 2))
        return CompiledGrammar(spec, matcher, first)

    def _keep(self, digest: str, entry: CompiledGrammar | InvalidConstraint) -> None:
        with self._lock:
            self._entries[digest] = entry
            self._entries.move_to_end(digest)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
