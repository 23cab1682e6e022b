"""The one error a question's own input raises inside the engine: it becomes that question's error answer,
never a failure of the step or of its neighbours."""

from __future__ import annotations


class QuestionRejected(Exception):
    """The question cannot run; it gets an error answer with this code."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message
