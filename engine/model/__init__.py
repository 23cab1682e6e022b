"""The model: its shape, weights and tokenizer, the decoder forward, and the sampler."""

from engine.model.model import Model, ModelSpec, load_model

__all__ = ["Model", "ModelSpec", "load_model"]
