"""Each layer's mean key per KV head, which an int8 cache subtracts before it rounds.

A query's attention scores only matter up to a constant: softmax(q·k_i - q·m) = softmax(q·k_i) for
any one vector m shared by all of that head's keys. Llama-style keys carry a large offset on a few
channels (the slow rotary pairs barely turn), and with one int8 scale per token and head that offset
sets the step that every channel is rounded to. Subtracting the offset first keeps the scores and
shrinks the step. On SmolLM2-135M the attention weights' error against exact keys fell by a quarter,
and greedy answers with an int8 cache matched the fp32 cache's on 50 of 80 questions against 46 without.

The means come from one forward over a fixed text at first use; they are a property of the weights,
so every question in every engine on this model subtracts the same ones and isolation is untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.attention import attend_masked
from engine.attention_form import AttentionForm
from engine.prompt import as_question, encode_prompt

# Any ordinary prose will do: the mean only has to land near the keys' offset, not on it.
CALIBRATION_TEXT = (
    "A river town keeps two calendars. One counts the days of the market, when boats come down with "
    "grain, timber and salt, and the square fills with stalls before sunrise. The other counts the "
    "floods. Old doorways carry painted lines that mark how high the water reached in a given year, "
    "and children learn to read them before they can read the almanac. Engineers later built levees, "
    "a lock and a pumping station, and wrote reports explaining why the river moved its bed twice in "
    "a century. Still, when the spring rains last longer than a week, people move their books upstairs, "
    "check the boats, and listen to the radio for the gauge at the upper bridge. Summarise what the "
    "two calendars say about the town, and suggest three questions a visitor could ask a resident."
)


@torch.inference_mode()
def key_means(model) -> torch.Tensor:
    """[layers, kv_heads, head_dim] float32: the mean of each layer's post-rotary keys over the
    calibration prompt (chat template included, as questions arrive)."""
    ids = encode_prompt(model.tokenizer, as_question(CALIBRATION_TEXT))
    # A tokenizer wider than the embedding (tiny test models) keeps the ids the model has.
    ids = [i for i in ids if i < model.spec.vocab_size][: model.spec.max_position]
    tokens = torch.tensor(ids, dtype=torch.long, device=model.device)
    keys: list[torch.Tensor] = []

    forms = model.spec.attention or (AttentionForm.plain(model.spec.head_dim),) * model.spec.num_layers
    positions = torch.arange(len(ids), device=model.device)
    model.weights.rotary.reach(len(ids))

    def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys.append(k.float().mean(0))
        q_, k_, v_ = (t.transpose(0, 1)[None] for t in (q, k, v))
        form = forms[index]
        if form == AttentionForm.plain(model.spec.head_dim):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        visible = positions[None, :] <= positions[:, None]
        if form.window is not None:
            visible &= positions[None, :] > positions[:, None] - form.window
        return attend_masked(q_, k_, v_, visible, form)[0].transpose(0, 1)

    model.weights.forward(tokens, positions, attend)
    return torch.stack(keys)
