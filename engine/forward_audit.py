"""The per-forward isolation audit as a step hook (options.audit: isolation.debug or log level debug):
each forward's `forward.mask` record, or `forward.isolation_violation` naming what broke, and how each
question's last speculative draft fared once it ends (`question.verified`, then `engine.drained`)."""

from __future__ import annotations

import structlog

from engine.audit import DraftEndings, forward_summary, per_question, violations
from engine.sequence import Sequence
from engine.step_plan import StepPlan

log = structlog.get_logger("kev.engine")


class ForwardAudit:
    def __init__(self, scheduler, block_size: int, routing: bool) -> None:
        self.scheduler, self.block_size, self.routing = scheduler, block_size, routing
        self.draft_endings = DraftEndings()
        self.forwards = 0

    def forward(self, number: int, plan: StepPlan, out) -> None:
        self.forwards = number
        chunks, segments, drafts = per_question(out.owners, out.segments)
        record = forward_summary(number, [c.seq.question_id for c in chunks], segments, self.block_size,
                                 routing=self.routing,
                                 prefixes=[self.scheduler.shared_prefix(c.seq) for c in chunks], drafts=drafts)
        problems = violations(record)
        if problems:
            log.error("forward.isolation_violation", problems=problems, **record)
        else:
            log.info("forward.mask", **record)  # audit is on only when asked for: show it at the default level
        self.draft_endings.drafted(number, chunks)

    def ended(self, finished: list[Sequence]) -> None:
        """How the last draft of each question that just ended fared (no later `forward.mask` will say), and,
        with speculative decoding on, `engine.drained` once none is left: every draft so far is settled."""
        for seq in finished:
            record = self.draft_endings.ended(seq)
            if record:
                log.info("question.verified", **record)
        if finished and not self.scheduler.has_work and self.scheduler.speculation is not None:
            log.info("engine.drained", forward=self.forwards)
