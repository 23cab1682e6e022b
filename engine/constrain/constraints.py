"""Structured answers inside the packed step: what EngineCore asks of engine/constrain/.

    prepare(question)         any thread: compile (or find cached) its response_format; QuestionRejected if bad
    attach(question)          device thread, at admission: the question's own Constraint, or None
    row_masks(chunks)         device thread, after the forward: the bias rows of the rows being drawn
    advance(new_tokens)       device thread, after drawing: feed each token to its grammar, start the
                              next step's masks on the worker; returns the questions whose grammar broke

A question without a response_format costs one attribute check per step.
"""

from __future__ import annotations

from engine.constrain.grammars import GrammarCache
from engine.constrain.masks import MaskWorker, RowMasks
from schemas.constraint import InvalidConstraint, spec_of
from engine.constrain.state import Constraint
from engine.rejection import QuestionRejected
from schemas import QuestionEvent


class Constraints:
    def __init__(self, tokenizer, stop_token_ids: tuple[int, ...], width: int, device, cache_size: int):
        self.stop_token_ids = stop_token_ids
        self.width = width  # the model's logits width
        self.device = device
        self.grammars = GrammarCache(tokenizer, stop_token_ids[0] if stop_token_ids else 0, cache_size)
        self.masks = MaskWorker(device)
        self.questions = 0  # questions admitted with a constraint

    def prepare(self, question: QuestionEvent):
        """The compiled grammar of the question's response_format (None without one); QuestionRejected
        (invalid_field) naming the problem when it cannot be compiled. Safe on any thread."""
        try:
            spec = spec_of(question.params.response_format)
            return None if spec is None else self.grammars.get(spec)
        except InvalidConstraint as bad:
            raise QuestionRejected("invalid_field", str(bad)) from None

    def attach(self, question: QuestionEvent) -> Constraint | None:
        compiled = self.prepare(question)  # a cache hit when Engine compiled it beforehand
        if compiled is None:
            return None
        self.questions += 1
        return Constraint(compiled, self.stop_token_ids, self.width, bias=self.device.type == "cpu")

    def row_masks(self, chunks) -> RowMasks | None:
        """For the runner: the masks of `chunks` (the plan's sampled chunks, in logits row order)."""
        held = [None if c.seq.status.finished else c.seq.constraint for c in chunks]
        return self.masks.rows(held, self.width)

    def advance(self, new_tokens) -> list:
        """Feed each drawn token to its question's grammar; returns the sequences whose grammar refused it."""
        self.masks.join()  # the matchers are the worker's until it is done
        broken, running = [], []
        for seq, token in new_tokens:
            constraint = seq.constraint
            if constraint is None:
                continue
            if not constraint.consume(token):
                seq.error = constraint.failed
                broken.append(seq)
            elif not seq.status.finished:
                running.append(constraint)
        self.masks.start(running)
        return broken

    def close(self) -> None:
        self.masks.close()
