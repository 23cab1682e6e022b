"""`write_random_adapter`: a PEFT-format LoRA adapter with random weights, for the tests that load adapters
(control, trust, replay) and for `python -m benchmarks.lora`, which imports it from here."""

from __future__ import annotations

import json
from pathlib import Path


def write_random_adapter(directory: Path, model, rank: int, seed: int, b_std: float = 0.02) -> Path:
    """A PEFT-format LoRA adapter on every linear target, random A and small random non-zero B."""
    import torch
    from safetensors.torch import save_file

    from engine.adapters.files import TARGETS, target_shapes

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.spec.num_layers):
        for target, (features_in, features_out) in target_shapes(model.spec).items():
            block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, features_in, generator=generator) / features_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(features_out, rank, generator=generator) * b_std
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "use_rslora": False, "bias": "none",
              "target_modules": list(TARGETS), "base_model_name_or_path": model.name}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory
