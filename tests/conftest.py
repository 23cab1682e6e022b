"""Shared fixtures: tiny random-weight transformers models (the reference for Kev's math), the real
SmolLM2-135M, and a small harness that drives EngineCore on raw token ids and records what it computed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import structlog
import torch

from schemas import DEFAULT_MODEL

torch.set_num_threads(2)

VOCAB = 256  # small, and every id below it decodes with the SmolLM2 tokenizer
EMBED_STD = 0.125  # = 1/sqrt(hidden): tied models do not collapse onto one token
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}

# kind -> (transformers class name, extra config); covers biases (Qwen2), q/k norms (Qwen3),
# llama3 rope scaling, tied and untied output layers.
TINY_KINDS = {
    "llama": ("LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3-rope-tied": ("LlamaForCausalLM", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3-tied": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
}
SMOLLM2 = DEFAULT_MODEL


def build_hf_tiny(kind: str, seed: int = 0, kinds: dict | None = None, **overrides):
    """A transformers model of `kind` (in `kinds`, TINY_KINDS by default) with random weights everywhere
    (norms and biases too), fp32, eval."""
    import transformers

    cls_name, extra = (kinds or TINY_KINDS)[kind]
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**{**TINY_SHAPE, "vocab_size": VOCAB, **extra, **overrides})
    config.architectures = [cls_name]
    torch.manual_seed(seed)
    return randomize(cls(config).eval())


def randomize(model):
    """Random weights everywhere, norms and biases too, drawn from torch's current seed."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(EMBED_STD * torch.randn_like(param))
            else:  # fan-in scaling keeps activations O(1), so logits are spread and greedy ties are rare
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[1] if param.dim() > 1 else param.numel()))
    return model


def kev_model_from_hf(hf_model, tokenizer, dtype: torch.dtype = torch.float32, name: str = "tiny",
                      matmul: str = "auto"):
    """Kev's Model over exactly the weights of `hf_model`; `matmul`: core.matmul."""
    from engine.model.model import Model, rope_tables, spec_from_config
    from engine.model.transformer import Transformer

    config = hf_model.config
    spec = spec_from_config(config)
    device = torch.device("cpu")
    weights = Transformer.from_state_dict(spec, hf_model.state_dict(), rope_tables(config, spec), device, dtype,
                                          matmul_kernel=matmul)
    return Model(spec, weights, tokenizer, device, dtype, Path(name), config)


@dataclass
class Tiny:
    kind: str
    hf: object  # transformers model, fp32
    kev: object  # engine.model.model.Model, fp32, same weights


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from engine.model.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(SMOLLM2))


@pytest.fixture(scope="session")
def tiny_models(smollm2_tokenizer) -> dict[str, Tiny]:
    """One Tiny per kind in TINY_KINDS, built once per session."""
    models = {}
    for i, kind in enumerate(TINY_KINDS):
        hf = build_hf_tiny(kind, seed=100 + i)
        models[kind] = Tiny(kind, hf, kev_model_from_hf(hf, smollm2_tokenizer, name=f"tiny-{kind}"))
    return models


@pytest.fixture(params=list(TINY_KINDS))
def tiny(request, tiny_models) -> Tiny:
    """Parametrizes a test over every tiny architecture."""
    return tiny_models[request.param]


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct, fp32 on CPU (converted cache; ~2 s)."""
    from engine import load_model

    return load_model(SMOLLM2, device="cpu", dtype="fp32")


# -- the harness: drive EngineCore on raw token ids ------------------------------------------------

@dataclass
class Q:
    """One question for the harness: its id, prompt token ids, Params fields and other event fields."""

    qid: str
    prompt_ids: list[int]
    params: dict = field(default_factory=dict)
    event: dict = field(default_factory=dict)  # e.g. tenant, cache_salt, adapter


@dataclass
class Outcome:
    answers: dict  # qid -> AnswerEvent
    logits: dict  # qid -> [float32 logits of each draw], prefill's last row first
    plans: list  # per forward (empty steps left out): [(qid, start, length, sample)] in row order
    positions: list  # per forward: the position ids fed to the model
    core: object
    draws: dict = field(default_factory=dict)  # qid -> {index of the drawn token: its logits, the last computed}

    def tokens(self, qid: str) -> list[int]:
        return list(self.answers[qid].token_ids)


def tiny_options(**overrides):
    """EngineOptions sized for tiny models: a small pool, no batching window, greedy defaults (no env)."""
    from engine import EngineOptions
    from engine.sampling_defaults import Defaults

    base = dict(num_blocks=512, block_size=16, max_context=512, batch_window_ms=0.0, defaults=Defaults())
    return EngineOptions(**{**base, **overrides})


def run_core(model, questions: list[Q], options=None, *, later: dict[int, list] | None = None,
             core=None) -> Outcome:
    """Add `questions`, step until all end; `later[n]` are added right before step n (0-based)
    (a callable there is called with the core instead, e.g. to update the defaults mid-run).

    Records every drawn row's logits per question (the runner's one `logits` call per step) and
    every forward's plan and position ids.
    """
    from engine import EngineCore
    from engine.model.transformer import Transformer
    from schemas import Params, QuestionEvent

    core = core or EngineCore(model, options or tiny_options())
    weights = core.runner.weights
    later = dict(later or {})
    out = Outcome({}, {}, [], [], core)
    current: list = []

    def add(q: Q) -> None:
        event = QuestionEvent(question_id=q.qid, prompt="(token ids)", params=Params(**q.params), **q.event)
        core.add(event, prompt_ids=list(q.prompt_ids))
        out.logits[q.qid] = []

    def schedule():
        plan = original_schedule()
        current[:] = [plan]
        if plan:
            out.plans.append([(c.seq.question_id, c.start, c.length, c.sample) for c in plan.chunks])
        return plan

    def forward(ids, positions, attend, **lora):  # lora=: the step's adapters, when any question has one
        out.positions.append(positions.tolist())
        return Transformer.forward(weights, ids, positions, attend, **lora)

    def logits(hidden):
        result = Transformer.logits(weights, hidden)
        rows = iter(result)
        for chunk in current[0].sampled_chunks:  # a drafting chunk draws a row per draft too
            for i in range(chunk.num_sample_rows):
                row = next(rows).detach().float().clone()
                out.logits.setdefault(chunk.seq.question_id, []).append(row)
                out.draws.setdefault(chunk.seq.question_id, {})[chunk.seq.num_tokens + i] = row
        return result

    original_schedule = core.scheduler.schedule
    core.scheduler.schedule = schedule
    weights.forward, weights.logits = forward, logits  # on the instance; removed again below
    try:
        for q in questions:
            add(q)
        step = 0
        while core.has_work or later:
            for item in later.pop(step, []):
                item(core) if callable(item) else add(item)
            for answer in core.step().answers:
                out.answers[answer.question_id] = answer
            step += 1
            assert step < 10_000, "the engine never finished"
    finally:
        del weights.forward, weights.logits
        core.scheduler.schedule = original_schedule
    return out


def random_prompt(rng, length: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.fixture(scope="session")
def harness():
    """The harness functions, for test modules: harness.run_core, harness.Q, harness.tiny_options, ..."""
    import types

    return types.SimpleNamespace(run_core=run_core, Q=Q, tiny_options=tiny_options, random_prompt=random_prompt,
                                 build_hf_tiny=build_hf_tiny, kev_model_from_hf=kev_model_from_hf, randomize=randomize,
                                 VOCAB=VOCAB, TINY_KINDS=TINY_KINDS)


@pytest.fixture
def logs():
    """structlog's captured records, debug and info included whatever level another test configured."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as captured:
            yield captured
    finally:
        structlog.configure(**saved)
