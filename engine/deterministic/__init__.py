"""Deterministic (batch-invariant) mode, behind one interface: `MathMode` (mode.py), chosen once per
engine, gives the forward its matmul, attention, LoRA batch and start-up check. The rest exists only for
this mode: fixed-tile matmuls and their check (tiles.py), fixed-tile attention (attention.py), LoRA per
adapter in tiles (lora.py)."""
