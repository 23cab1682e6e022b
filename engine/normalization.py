"""router.normalize: seed 002's gateway clean-up of what a user typed, before the model reads it.

Repeated punctuation and whitespace are collapsed, and filler words and long empty prefixes at the start
are stripped, so the model spends no tokens on them. It is a function of the text alone, applied to each
question by itself (EngineCore.prepare), so a question gets the same prompt tokens alone or packed.
semantic_hash (engine/routing_embedding.py) always routes on the normalised text, whatever the setting.

What changes, in order (the rules are deliberately narrow: code, URLs and markdown in a prompt survive):
- the start: a run of whitespace and sentence punctuation (`...`, `？？`, blank lines) goes, as does a rule
  line of four or more `-`, `_`, `=`, `*` or `~`; then fillers go, one after another, each with the
  punctuation and spaces after it:
  - English `um`, `umm`, `uh`, `uhh`, `uhm`, `erm`, `hm`, `hmm`, `emm` (whole words), and `well,` / `so,`
    (only with the comma: "so what" may be the question);
  - Chinese `嗯`, `呃`, `额`, `啊`, `那个`, `这个`, `就是`, only when punctuation or a space follows
    (那个人是谁 asks about "that person"; 额度 is "a credit limit"; 呃逆 is "hiccups");
  - the openers `请问`, `我想问一下`, `想问一下` ("may I ask"), with or without punctuation after them;
  a question that began with a capital letter begins with one again (an "iPhone" stays);
- everywhere: a run of one repeated mark among `! ? , ; 。 ！ ？ ， ； 、` becomes one mark (`.`, `:`, `-`, `/`,
  `*`, `=` and backticks are left alone: `...`, `::`, `https://`, `**`, `==`, code fences);
- whitespace: a run of spaces or tabs after text becomes one space (lines keep their indentation, but for
  the first), spaces at line ends go, more than one blank line becomes one, and the text is stripped at
  both ends. A text of filler alone ends empty.

Normalising twice changes nothing more than once.
"""

from __future__ import annotations

import re

import msgspec

from schemas import Message, QuestionEvent

_SENTENCE_MARKS = r"\s.,!?;…~、。，！？；～：·"
_EMPTY_PREFIX = re.compile(rf"(?:[{_SENTENCE_MARKS}]+|([-_=*~])\1{{3,}})+")
_FILLER = re.compile(
    rf"(?:(?:um+|uh+m?|erm+|hm+|emm+)\b[{_SENTENCE_MARKS}-]*"
    rf"|(?:well|so),\s*"
    rf"|(?:嗯+|呃+|额|啊+|那个|这个|就是)[{_SENTENCE_MARKS}]+"
    rf"|(?:请问|我?想问一下)[{_SENTENCE_MARKS}]*)",
    re.IGNORECASE)
_REPEATED_MARK = re.compile(r"([!?,;。！？，；、])\1+")
_INNER_SPACES = re.compile(r"(?<=\S)[ \t\u3000]{2,}")
_LINE_END_SPACES = re.compile(r"[ \t\u3000]+(?=\n)")
_BLANK_LINES = re.compile(r"\n{3,}")


def normalize_text(text: str) -> str:
    """`text` as router.normalize gives it to the model (the rules are in the module's docstring)."""
    original, start = text, _strip_start(text)
    if start[:1].islower() and not start[1:2].isupper() and _first_letter(original).isupper():
        start = start[0].upper() + start[1:]  # "Um, how do I ..." reads "How do I ..."
    text = _REPEATED_MARK.sub(r"\1", start)
    text = _INNER_SPACES.sub(" ", text)
    text = _LINE_END_SPACES.sub("", text)
    return _BLANK_LINES.sub("\n\n", text).strip()


def normalized(question: QuestionEvent) -> QuestionEvent:
    """`question` with its user text normalised: the prompt, or the content of each user message.

    The system prompt and assistant turns are left as written; so is a raw question (its prompt is
    continued exactly as sent). The same object comes back when nothing changes.
    """
    if question.raw:
        return question
    if question.prompt is not None:
        prompt = normalize_text(question.prompt)
        return question if prompt == question.prompt else msgspec.structs.replace(question, prompt=prompt)
    messages = tuple(_normalized_message(m) for m in question.messages or ())
    if all(new is old for new, old in zip(messages, question.messages or ())):
        return question
    return msgspec.structs.replace(question, messages=messages)


def _normalized_message(message: Message) -> Message:
    if message.role != "user":
        return message
    content = normalize_text(message.content)
    return message if content == message.content else msgspec.structs.replace(message, content=content)


def _strip_start(text: str) -> str:
    while True:
        empty = _EMPTY_PREFIX.match(text)
        text = text[empty.end():] if empty else text
        filler = _FILLER.match(text)
        if filler is None:
            return text
        text = text[filler.end():]


def _first_letter(text: str) -> str:
    return next((c for c in text if c.isalpha()), "")
