"""How much of its prompt a question's sample may share through the prefix cache, by isolation level.

Every sample gets a prefix-cache salt: the model, the tenant where `prefix_scope` is tenant, and the
question's own salt. Under `system_prefix` its hash chain stops at the last block wholly inside the
prompt's system part (engine/system_prefix.py), so no other block of it is named in the cache.
"""

from __future__ import annotations

from engine.kv.prefix_cache import chain_hashes, prefix_salt
from engine.options import EngineOptions
from engine.sequence import Sequence
from engine.system_prefix import SystemPrefix
from schemas import QuestionEvent


class PrefixSharing:
    """Salts (and, under system_prefix, hash chains) for the samples of one engine's questions."""

    def __init__(self, model, options: EngineOptions, block_size: int):
        self.model = model
        self.options = options
        self.block_size = block_size
        self.system_prefix = SystemPrefix(model.tokenizer) if options.prefix_system_only else None

    def share(self, question: QuestionEvent, seq: Sequence, samples_salt: str | None = None) -> None:
        """Give `seq` its prefix-cache salt (isolation.level system_prefix or shared); under system_prefix its
        hash chain stops at the last block wholly inside its prompt's system part, so no other block of it is
        ever named in the cache, nor read from it. `samples_salt`: a question's samples share their whole
        prompt with each other alone where the level shares less than that with others."""
        tenant = question.tenant if self.options.prefix_scope == "tenant" else None
        if samples_salt is not None and (not self.options.prefix_caching or self.system_prefix is not None):
            seq.cache_salt = prefix_salt(str(self.model.path), tenant, samples_salt, seq.cache_namespace)
            return
        if not self.options.prefix_caching:
            return
        seq.cache_salt = prefix_salt(str(self.model.path), tenant, question.cache_salt, seq.cache_namespace)
        if self.system_prefix is not None:
            system = self.system_prefix.length(question, seq.prompt_ids)
            seq.prefix_hashes = chain_hashes(seq.cache_salt, seq.prompt_ids[:system], self.block_size)
