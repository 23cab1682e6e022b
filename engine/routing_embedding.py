"""semantic_hash: a question's bucket from the meaning of its words, through the model's embedding layer.

Seed 002 routes this way: each question goes through the embedding layer, its vector is hashed to a bucket,
so questions that mean nearly the same share a channel. Here that is random-hyperplane LSH over the mean of
the question's input-embedding rows. It needs the model's tokenizer and embedding table, so it runs where
they are: `kev route` (kev_async passes it to consumers' Partitioner as a callable) and a worker, for the
audit's routing bucket. schemas/routing.py keeps the rules any client can compute without a model.

The rule, fixed so that every process with the same model files agrees:
1. the question's user text (its prompt, or its user messages' contents joined by newlines), normalised
   (engine/normalization.py, whatever router.normalize says), its first TEXT_CHARS characters;
2. its token ids from the model's tokenizer without special tokens (a special token written in the text is
   dropped too);
3. the mean of those ids' rows of the input embedding table (the float32 rows, summed in float64);
4. minus the table's mean row, and less its component along the table's first principal direction: every
   row leans that way, and left in, it puts most questions in a few buckets ("all-but-the-top", Mu and
   Viswanath, ICLR 2018);
5. the signs of its dot products with BITS hyperplanes (standard normal, numpy's RandomState(SEED), whose
   stream numpy keeps fixed across versions; float64), the first hyperplane the highest bit of a BITS-bit
   signature; no tokens: signature 0;
6. bucket = signature * n >> BITS: n equal ranges of signatures, so questions that agree on the first
   hyperplanes share a bucket (for n a power of two, exactly the first log2(n) of them).
Deterministic within a process and across processes on one machine. On another BLAS build the mean
direction of step 4 and the products of step 5 may differ in the last bits, which moves a question only
if its vector lies within that rounding of a hyperplane.

Only the table is read, never the model: it is memory-mapped from the safetensors file, or, for a GGUF whose
blocks Kev keeps, its rows are read from the GGUF and dequantized as asked (WeightRows: the same float32
values a conversion to safetensors would hold). A lookup reads its rows alone; the mean and principal
direction read the table once (about 0.4 s for SmolLM2's 49152 x 576).
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import numpy as np

from engine.normalization import normalize_text
from schemas import QuestionEvent

BITS = 16
SEED = 40  # any fixed value: every process must draw the same hyperplanes
TEXT_CHARS = 2048  # a long prompt's start says what it is about; tokenizing all of it would cost milliseconds
EMBEDDING_TENSOR = "model.embed_tokens.weight"
_CHUNK_ROWS = 4096
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class EmbeddingHash:
    """semantic_hash's bucket of a question, from a tokenizer (`tokenizers.Tokenizer`) and an embedding table."""

    def __init__(self, table: np.ndarray | WeightRows, tokenizer, *, bits: int = BITS, seed: int = SEED) -> None:
        self.table = table
        self.tokenizer = tokenizer
        self.bits = bits
        self.special_ids = frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)
        self.center, self.top = _mean_and_top_direction(table)
        self.planes = _hyperplanes(seed, bits, table.shape[1])
        self._weights = 1 << np.arange(bits - 1, -1, -1, dtype=np.int64)

    @classmethod
    def from_model_dir(cls, path: str | Path, **options) -> EmbeddingHash:
        """From an HF-format directory (engine.model.loader.resolve_model_dir gives the built-in model's)."""
        path = Path(path)
        return cls(embedding_table(path), _tokenizer(path), **options)

    @classmethod
    def from_source(cls, source: str, **options) -> EmbeddingHash:
        """For a model as `load_model` names it (a directory, a .gguf, a built-in name), without loading it.
        A GGUF whose blocks Kev keeps is not converted: its table's rows are read from the file, the same
        float32 values a conversion would write (`kev route` and a worker on that file agree)."""
        from engine.model.gguf_weights import runs_as_stored
        from engine.model.loader import gguf_file, resolve_model_dir

        gguf = gguf_file(source)
        if gguf is None or not runs_as_stored(gguf):
            return cls.from_model_dir(resolve_model_dir(source), **options)
        import torch
        from transformers import AutoConfig

        from engine.model.gguf_weights import GgufState, load_name_map

        path = resolve_model_dir(source, weights=False)
        state = GgufState(gguf, AutoConfig.from_pretrained(path), torch.float32, load_name_map(path))
        return cls(weight_table(state[EMBEDDING_TENSOR]), _tokenizer(path), **options)

    @classmethod
    def for_model(cls, model, **options) -> EmbeddingHash:
        """For a loaded engine.model.Model: its directory's safetensors table, or its weights' own where it
        has none (a GGUF kept in blocks, or a model built in memory)."""
        if _has_safetensors(model.path):
            return cls.from_model_dir(model.path, **options)
        return cls(weight_table(model.weights.embed), model.tokenizer.backend_tokenizer, **options)

    def reseeded(self, seed: int) -> EmbeddingHash:
        """The same rule under other hyperplanes (how a benchmark shows SEED is not a lucky pick)."""
        other = copy.copy(self)
        other.planes = _hyperplanes(seed, self.bits, self.table.shape[1])
        return other

    def __call__(self, question: QuestionEvent, num_buckets: int) -> int:
        return self.bucket(question, num_buckets)

    def bucket(self, question: QuestionEvent, num_buckets: int) -> int:
        """The question's bucket in 0..num_buckets-1."""
        return self.signature(user_text(question)) * num_buckets >> self.bits

    def signature(self, text: str) -> int:
        """The BITS-bit LSH signature of `text` (steps 1-5 of the module's rule; `text` as the user wrote it)."""
        vector = self.vector(text)
        if vector is None:
            return 0
        return int((self.planes @ vector > 0) @ self._weights)

    def vector(self, text: str) -> np.ndarray | None:
        """The centred mean embedding the hyperplanes cut (steps 1-4); None for a text with no tokens."""
        encoded = self.tokenizer.encode(normalize_text(text)[:TEXT_CHARS], add_special_tokens=False).ids
        ids = [i for i in encoded if i not in self.special_ids]
        if not ids:
            return None
        vector = self.table[ids].astype(np.float64).mean(axis=0) - self.center
        return vector - self.top * (self.top @ vector)


def user_text(question: QuestionEvent) -> str:
    """What the user asked: the prompt, or the user messages' contents (not the system prompt: prefix_hash
    routes by that)."""
    if question.prompt is not None:
        return question.prompt
    return "\n".join(m.content for m in question.messages or () if m.role == "user")


def _tokenizer(path: Path):
    from tokenizers import Tokenizer

    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    from transformers import AutoTokenizer  # a directory with a slow tokenizer's files only: it builds the fast one

    return AutoTokenizer.from_pretrained(path).backend_tokenizer


def _has_safetensors(path: Path | None) -> bool:
    return path is not None and any((path / name).is_file()
                                    for name in ("model.safetensors", "model.safetensors.index.json"))


class WeightRows:
    """A model's embedding weight kept in blocks (engine.kernels.block_weight), read as this module reads a
    table: `[ids]` and `[start:stop]` give float32 rows, dequantized as they are read, never all at once."""

    def __init__(self, weight) -> None:
        self.weight, self.shape = weight, tuple(weight.shape)

    def __getitem__(self, index) -> np.ndarray:
        import torch

        ids = torch.arange(self.shape[0])[index] if isinstance(index, slice) else torch.as_tensor(index)
        return self.weight.rows(ids.long(), torch.float32).numpy()


def weight_table(weight) -> np.ndarray | WeightRows:
    """The float32 table of a model's embedding weight: a dense tensor's values, or a block weight's rows."""
    if hasattr(weight, "rows"):
        return WeightRows(weight)
    return weight.detach().float().cpu().numpy()


def embedding_table(path: Path) -> np.ndarray:
    """The input embedding table of the model in `path`, memory-mapped from its safetensors (one file or
    shards named by model.safetensors.index.json); bf16 is widened to float32 in memory."""
    index = path / "model.safetensors.index.json"
    name = json.loads(index.read_text())["weight_map"][EMBEDDING_TENSOR] if index.is_file() else "model.safetensors"
    file = path / name
    with open(file, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        entry = json.loads(f.read(header_len))[EMBEDDING_TENSOR]
    dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"{file}: {EMBEDDING_TENSOR} is {entry['dtype']}; semantic_hash reads F32, F16 or BF16")
    table = np.memmap(file, dtype=dtype, mode="r", offset=8 + header_len + entry["data_offsets"][0],
                      shape=tuple(entry["shape"]))
    if entry["dtype"] == "BF16":  # bf16 is the top half of a float32
        return (table.astype(np.uint32) << 16).view(np.float32)
    return table


def _mean_and_top_direction(table: np.ndarray | WeightRows) -> tuple[np.ndarray, np.ndarray]:
    """The table's mean row and its covariance's top eigenvector (unit length), in float64."""
    rows, dim = table.shape
    total, gram = np.zeros(dim), np.zeros((dim, dim))
    for start in range(0, rows, _CHUNK_ROWS):  # float64 a chunk at a time: never the whole table twice over
        chunk = np.asarray(table[start:start + _CHUNK_ROWS], dtype=np.float64)
        total += chunk.sum(axis=0)
        gram += chunk.T @ chunk
    mean = total / rows
    _, vectors = np.linalg.eigh(gram / rows - np.outer(mean, mean))
    return mean, vectors[:, -1]


def _hyperplanes(seed: int, bits: int, dim: int) -> np.ndarray:
    return np.random.RandomState(seed).standard_normal((bits, dim))
