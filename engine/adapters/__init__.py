"""LoRA adapters: read from disk, kept resident, applied per row inside one forward."""

from engine.adapters.files import AdapterError, LoraAdapter

__all__ = ["AdapterError", "LoraAdapter"]
