"""The next step's masks, computed while the forward runs.

Right after a step draws and its constrained questions consume their tokens, `MaskWorker.start` hands
those questions to one worker thread, which computes each one's next mask (llguidance drops the GIL,
and so does torch's unpacking). The next step's forward runs meanwhile on the device thread; just
before sampling, `rows` joins the worker and stacks the masks of the rows being drawn. A row whose
mask is not ready (a question's first token after a chunked prefill, a worker still busy) is computed
then and there, and counted.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.constrain.state import Constraint, bias_rows


@dataclass(frozen=True)
class RowMasks:
    """The sampler's view: `rows` (indices into the logits) are added `bias` ([len(rows), width])."""

    rows: torch.Tensor
    bias: torch.Tensor


@dataclass
class MaskStats:
    masks: int = 0  # masks computed
    mask_seconds: float = 0.0  # spent computing them, on whichever thread
    late: int = 0  # computed on the device thread, at sampling, because the worker had not
    wait_seconds: float = 0.0  # the device thread waited for the worker at sampling (0 when it overlapped)
    steps: int = 0  # steps that drew at least one constrained row


class MaskWorker:
    def __init__(self, device: torch.device):
        self.device = device
        self.stats = MaskStats()
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None

    def start(self, constraints: list[Constraint]) -> None:
        """Compute these constraints' next masks on the worker thread; returns at once."""
        self.join()
        if not constraints:
            return
        if self._pool is None:  # started at the first structured question: engines without any have no thread
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kev-masks")
        self._job = self._pool.submit(self._fill, constraints)

    def join(self) -> None:
        """Wait for the worker's masks (a no-op when none are being computed)."""
        if self._job is not None:
            job, self._job = self._job, None
            job.result()

    def rows(self, constraints: list[Constraint | None], width: int) -> RowMasks | None:
        """The masks of the rows about to be drawn (None where a row is free); None when all are free."""
        if all(c is None for c in constraints):
            return None
        waited = time.perf_counter()
        self.join()
        self.stats.wait_seconds += time.perf_counter() - waited
        self.stats.steps += 1
        indices, held = [], []
        for i, constraint in enumerate(constraints):
            if constraint is None:
                continue
            if not constraint.ready:
                self.stats.late += 1
                self._fill([constraint])
            indices.append(i)
            held.append(constraint)
        rows = torch.tensor(indices, dtype=torch.long, device=self.device)
        if self.device.type == "cpu":
            return RowMasks(rows, torch.stack([c.bias for c in held]))
        bits = torch.stack([c.bits for c in held]).to(self.device, non_blocking=True)
        return RowMasks(rows, bias_rows(bits, width))

    def close(self) -> None:
        self.join()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _fill(self, constraints: list[Constraint]) -> None:
        started = time.perf_counter()
        for constraint in constraints:
            constraint.fill()
        self.stats.masks += len(constraints)
        self.stats.mask_seconds += time.perf_counter() - started
