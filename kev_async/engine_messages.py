"""What the engine actor takes: questions in its inbox, cancels and control commands in its control mailbox.

Questions come as `Submit` (or any envelope with a `.question`, such as `consumers.Inbound`); cancels
and control commands go to the control mailbox, which the actor reads ahead of and apart from its
questions (kev_async/engine_actor.py), plainly or inside a `runtime.actors.Request` (`ask`) to get a
reply.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas import QuestionEvent
from schemas.principal import ANONYMOUS, Principal


@dataclass(frozen=True)
class Submit:
    question: QuestionEvent
    source: Any = None  # handed back with the answer when the actor has a `wrap`
    published_ms: int | None = None  # when it was published (ms since the epoch): its deadline counts from it
    principal: Principal = ANONYMOUS  # who asked: whose compile budget its response_format uses


@dataclass(frozen=True)
class Cancel:
    """End a question now (finish_reason "cancelled"): the engine applies it at its next step, and the
    question's KV blocks return to the pool that step. One still being prepared stops preparing; one not
    taken yet is cancelled the moment it is (kev_async/early_cancels.py)."""

    question_id: str


@dataclass(frozen=True)
class UpdateDefaults:
    """New sampling defaults for questions admitted from now on; send with `ask`, reply = the version."""

    changes: Mapping[str, Any] = field(default_factory=dict)
    command_id: int | None = None  # see LoadAdapter


@dataclass(frozen=True)
class LoadAdapter:
    """Load (or replace: a new version) a PEFT LoRA adapter; questions taken after it may name it.

    Applied between two steps, and awaited before the actor reads its next control message, so the
    commands behind it see it, and so does a question sent once its `ask` has returned. Send it
    plainly (a failure is logged) or with `ask` (reply = the engine's LoraAdapter, or the error
    raised)."""

    name: str
    path: str | os.PathLike
    # The kev.control record's offset. An engine applies each id once: a replay of the topic (the control
    # actor restarted) gets the first outcome again instead of loading a new version.
    command_id: int | None = None


@dataclass(frozen=True)
class UnloadAdapter:
    """New questions naming the adapter get `unknown_adapter`; those in flight finish with it.
    Plainly or with `ask` (reply = None, or the error: KeyError for a name that is not loaded)."""

    name: str
    command_id: int | None = None  # see LoadAdapter
