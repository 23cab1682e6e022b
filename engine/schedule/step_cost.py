"""StepCost: what a forward costs on this machine, learned from the forwards the engine runs.

    seconds ~ fixed + per_row * rows + per_key * keys

`rows` are the step's tokens, `keys` its attention reads: row i of a chunk starting at position s
reads s + i + 1 keys of its own question. Fitted by least squares over the latest WINDOW steps, so it
follows the load of a shared host. The scheduler sizes prompt chunks with `key_cost` (a key read,
counted in rows: only the ratio matters there, so the fixed part and the host's speed cancel) and
judges deadlines with `seconds`. Plain numbers, no torch: the engine hands in each step's time.
"""

from __future__ import annotations

from collections import deque

from engine.step_plan import chunk_keys

WINDOW = 128  # steps fitted: a few seconds of decoding, a minute of long prompts
MIN_STEPS = 16  # fewer, and nothing is claimed: `ready` is False
REFIT_EVERY = 8  # steps between fits (a fit is a 3x3 solve; the step loop should not pay it each time)
_ROW_SCALE, _KEY_SCALE = 1e3, 1e6  # features near 1, so the normal equations stay well conditioned


class StepCost:
    def __init__(self) -> None:
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self._since_fit = 0
        self._fit: tuple[float, float, float] | None = None  # fixed s, per row s, per key s

    def observe(self, rows: int, keys: int, seconds: float) -> None:
        """One forward of `rows` rows reading `keys` keys took `seconds`."""
        if rows <= 0 or seconds <= 0:
            return
        self._steps.append((rows / _ROW_SCALE, keys / _KEY_SCALE, seconds))
        self._since_fit += 1
        if len(self._steps) >= MIN_STEPS and (self._fit is None or self._since_fit >= REFIT_EVERY):
            self._fit = _fit(list(self._steps))
            self._since_fit = 0

    @property
    def ready(self) -> bool:
        return self._fit is not None

    @property
    def key_cost(self) -> float:
        """What reading one key costs, in rows; 0 until measured."""
        if self._fit is None:
            return 0.0
        _, per_row, per_key = self._fit
        return per_key / per_row

    def seconds(self, rows: int, keys: int) -> float | None:
        """The expected time of a forward; None until measured."""
        if self._fit is None:
            return None
        fixed, per_row, per_key = self._fit
        return fixed + per_row * rows + per_key * keys

    def prefill_seconds(self, tokens: int, per_step: int) -> float | None:
        """The least time `tokens` prompt tokens take alone, `per_step` at a time; None until measured."""
        if self._fit is None:
            return None
        total, start = 0.0, 0
        while start < tokens:
            rows = min(per_step, tokens - start)
            total += self.seconds(rows, chunk_keys(start, rows))
            start += rows
        return total


def _fit(steps: list[tuple[float, float, float]]) -> tuple[float, float, float] | None:
    """Least squares of seconds on (1, rows, keys), each coefficient at least 0; in seconds per unit."""
    for features in ((0, 1, 2), (0, 1)):  # keys that do not vary (or look free) are dropped, not guessed
        coefficients = _least_squares([[1.0, r, k][: len(features)] for r, k, _ in steps], [s for *_, s in steps])
        if coefficients is None or coefficients[1] <= 0:
            continue
        if len(coefficients) == 3 and coefficients[2] < 0:
            continue
        fixed = max(0.0, coefficients[0])
        per_key = coefficients[2] / _KEY_SCALE if len(coefficients) == 3 else 0.0
        return fixed, coefficients[1] / _ROW_SCALE, per_key
    return None


def _least_squares(x: list[list[float]], y: list[float]) -> list[float] | None:
    """Solve the normal equations (X^T X) b = X^T y by Gaussian elimination; None when singular."""
    n = len(x[0])
    a = [[sum(row[i] * row[j] for row in x) for j in range(n)] + [sum(row[i] * t for row, t in zip(x, y))]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [v - factor * p for v, p in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]
