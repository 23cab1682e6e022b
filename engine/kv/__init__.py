"""KV memory: the block allocator, the cache tensors and the prefix cache. No torch in the allocator."""
