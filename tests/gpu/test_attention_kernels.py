"""The CUDA path: flash-attn varlen + paged KV. Runs only where CUDA and flash-attn are present."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (CUDA)", allow_module_level=True)
pytest.importorskip("flash_attn", reason="needs flash-attn: pip install 'kev[gpu]'")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from engine import EngineCore, EngineOptions  # noqa: E402
from engine.deterministic.attention import FixedTileAttention  # noqa: E402
from engine.kernels.attention import Segment  # noqa: E402
from engine.kernels.flash import FlashAttention, flash_available  # noqa: E402
from engine.kv.cache import KVCache  # noqa: E402
from engine.model.model import Model, rope_tables, spec_from_config  # noqa: E402
from engine.model.transformer import Transformer  # noqa: E402
from schemas import Params, QuestionEvent  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def tiny_model(dtype=torch.bfloat16) -> Model:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
    cfg.architectures = ["LlamaForCausalLM"]
    hf = LlamaForCausalLM(cfg)
    spec = spec_from_config(cfg)
    weights = Transformer.from_state_dict(spec, hf.state_dict(), rope_tables(cfg, spec), CUDA, dtype)
    return Model(spec, weights, None, CUDA, dtype, None, cfg)


def test_flash_is_picked_on_cuda():
    assert flash_available(CUDA)
    core = EngineCore(tiny_model(), EngineOptions(num_blocks=64))
    assert isinstance(core.runner.attention, FlashAttention)
    assert core.block_size % 256 == 0


@pytest.mark.parametrize("q_lens,cached", [([1, 1, 1], [300, 17, 600]), ([40, 1, 7], [0, 33, 260]),
                                          ([100, 300], [0, 0])])
def test_flash_matches_torch_sdpa(q_lens, cached):
    spec = tiny_model().spec
    kv = KVCache(spec, num_blocks=16, block_size=256, dtype=torch.bfloat16, device=CUDA)
    segments, row, next_block = [], 0, 0
    for q_len, c in zip(q_lens, cached):
        blocks = -(-(c + q_len) // 256)
        segments.append(Segment(row, q_len, c + q_len, tuple(range(next_block, next_block + blocks))))
        row, next_block = row + q_len, next_block + blocks
    kv.k.normal_(), kv.v.normal_()
    q = torch.randn(row, spec.num_heads, spec.head_dim, device=CUDA, dtype=torch.bfloat16)
    k = torch.randn(row, spec.num_kv_heads, spec.head_dim, device=CUDA, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flash = FlashAttention(kv).prepare(segments)(0, q, k, v)
    reference = FixedTileAttention(kv).prepare(segments)(0, q, k, v)
    assert (flash.float() - reference.float()).abs().max() < 2e-2


def test_greedy_solo_equals_packed_on_gpu():
    model = tiny_model()
    prompts = [list(range(1, 30)), list(range(40, 240)), list(range(7, 12)), list(range(300, 311))]

    def run(indices):
        core = EngineCore(model, EngineOptions(num_blocks=64, batch_window_ms=0))
        for i in indices:
            core.add(QuestionEvent(question_id=f"q{i}", prompt="x", params=Params(max_new_tokens=24)),
                     prompt_ids=prompts[i])
        answers = {}
        while core.has_work:
            answers.update({a.question_id: a.token_ids for a in core.step().answers})
        return answers

    packed = run(range(len(prompts)))
    for i in range(len(prompts)):
        assert run([i])[f"q{i}"] == packed[f"q{i}"]
