"""Question events, the input side of the wire: a prompt or messages plus per-question sampling.

Every string and collection is bounded: the types hold hard ceilings (schemas/_validation.py).
schemas/question_decoding.py reads them from untrusted bytes (`decode_question`).
"""


from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from schemas._validation import (
    ID_CHARS_CEILING,
    MESSAGES_CEILING,
    TEXT_CHARS_CEILING,
    TOPIC_CHARS_CEILING,
    MaxNewTokens,
    RepetitionPenalty,
    Seed,
    StopStrings,
    Temperature,
    TopK,
    TopP,
)
from schemas.response_format import ResponseFormat
from schemas.samples import MAX_SAMPLES, MAX_TOP_LOGPROBS
from schemas.tools import CallId, ToolCalls, Tools
from schemas.wire import SCHEMA_VERSION

MAX_UNKNOWN_FIELDS = 32  # unknown keys named per question; more are counted as one "..." entry
UnknownName = Annotated[str, Meta(max_length=80)]
QuestionId = Annotated[str, Meta(min_length=1, max_length=ID_CHARS_CEILING)]
Id = Annotated[str, Meta(max_length=ID_CHARS_CEILING)]  # request_id, tenant, cache_salt, adapter
Text = Annotated[str, Meta(max_length=TEXT_CHARS_CEILING)]
TopicName = Annotated[str, Meta(max_length=TOPIC_CHARS_CEILING)]
Priority = Annotated[int, Meta(ge=-100, le=100)]
TimeoutMs = Annotated[int, Meta(ge=1, le=86_400_000)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
Samples = Annotated[int, Meta(ge=1, le=MAX_SAMPLES)]


class Message(Struct, frozen=True, omit_defaults=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text
    tool_calls: ToolCalls = ()  # an assistant's calls (schemas/tools.py)
    tool_call_id: CallId | None = None  # a tool message: the call it answers


class Params(Struct, frozen=True, omit_defaults=True):
    """Per-question sampling; None means "use the engine's default"."""

    max_new_tokens: MaxNewTokens | None = None
    temperature: Temperature | None = None  # 0 = greedy
    top_p: TopP | None = None
    top_k: TopK | None = None  # 0 = off
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: StopStrings = ()
    response_format: ResponseFormat | None = None  # JSON schema, JSON object, regex or grammar (docs/structured.md)
    # Per answer token its logprob, and the top_logprobs most likely tokens at that place: of the model's raw
    # distribution (before temperature, penalty, top-k/p and response_format), or "processed": the one drawn from
    logprobs: bool = False
    top_logprobs: TopLogprobs = 0
    logprobs_mode: Literal["raw", "processed"] = "raw"
    n: Samples = 1  # answers to draw, each its own seeded sample (schemas/samples.py), each its own event
    # n > 1 at temperature 0 draws n identical answers: refused unless this says that is meant
    allow_identical_samples: bool = False


class QuestionEvent(Struct, frozen=True, omit_defaults=True):
    question_id: QuestionId
    prompt: Text | None = None  # exactly one of prompt / messages
    messages: Annotated[tuple[Message, ...], Meta(max_length=MESSAGES_CEILING)] | None = None
    request_id: Id | None = None
    # tenant, cache_salt, priority, reply_topic and a timeout_ms above kafka.trust.max_unsigned_timeout_ms
    # are server-side: honoured only from a signed record (consumers/intake/trust.py)
    tenant: Id | None = None
    cache_salt: Id | None = None  # prefix cache scope within the tenant: only equal salts share a prefix
    system: Text | None = None
    tools: Tools = ()  # functions the model may call, rendered by its chat template (schemas/tools.py)
    params: Params = Params()
    adapter: Id | None = None
    priority: Priority = 0  # higher first
    timeout_ms: TimeoutMs | None = None
    stream: bool = False
    raw: bool = False  # the prompt's own tokens, no chat template: a plain continuation (/v1/completions)
    reply_topic: TopicName | None = None
    schema: int = SCHEMA_VERSION
    # Keys of the event (or of its params) Kev does not know, as `decode_question` found them: listed in
    # the answer's audit or refused, as `intake.unknown_fields` says. Set by the intake, not by producers
    # (names a producer sends here are kept beside the intake's own, so `kev route` passes them on).
    unknown_fields: Annotated[tuple[UnknownName, ...], Meta(max_length=MAX_UNKNOWN_FIELDS)] = ()
