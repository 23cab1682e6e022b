"""Compute kernels: attention backends (CPU paged decode in C++, CUDA flash-attn), packed and int8 weights, CPU feature checks."""
