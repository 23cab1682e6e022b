"""Everything that exists only for deterministic (batch-invariant) mode: fixed-tile matmuls and attention."""
