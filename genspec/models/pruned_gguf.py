"""A structurally pruned copy of a GGUF model, for a llama.cpp target's ``--drafter pruned``: the layers, query
heads and MLP channels a ``genspec calibrate prune`` plan keeps, cut out of the target's own tensors with the
``gguf`` package, with the plan's healed weights in place of the cut ones where it was healed.

Each cut follows the tensor's role (GGUF stores a matrix as ``(rows = outputs, columns = inputs)``):

- ``attn_q`` keeps the rows of its kept heads, ``attn_k`` / ``attn_v`` those of the kept key/value heads (a
  key/value head none of whose query heads is kept goes, as :func:`genspec.models.variants.pruned` drops it);
  ``attn_output`` keeps the columns of the kept query heads;
- ``ffn_gate`` / ``ffn_up`` keep the rows of the kept channels, ``ffn_down`` their columns;
- everything else (norms, embeddings, the output layer) is copied as it is.

A cut along rows keeps a quantised tensor's bytes as they are (each row is whole blocks). A cut along
columns does not: those tensors are dequantised, cut, and the copy requantised by llama.cpp's own quantiser
to the source's file type (Q4_K_M stays Q4_K_M); a float source's tensors stay in their float type.

Example: Gemma 3 270M (18 layers, 4 query heads and 1 key/value head of 256, 2048 channels) with ``--keep 0.5``:
every layer keeps 2 query heads, its key/value head and 1024 channels; ``attn_q`` goes from 1024 rows to 512,
``attn_output`` from 1024 columns to 512, ``ffn_down`` from 2048 columns to 1024.

A GGUF file names one head count, key/value head count and channel count for all its layers (the loaders of
llama.cpp's common architectures read them so), so a plan must keep as many of each in every kept layer; the
plans ``genspec calibrate prune`` writes for a model whose layers are alike do.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import numpy as np

from genspec.errors import ConfigError, InputFileError
from genspec.models.gguf_file import check_complete
from genspec.models.llamacpp import GGUFType, derived_gguf, kept_window_pattern

#: the version of what :func:`pruned_gguf` writes, part of a copy's name: a copy an earlier version wrote is
#: made anew
PRUNED_FORMAT = 1

#: a healed projection's name in the plan's weights file (the draft's kept-layer index, then the Hugging Face
#: module) -> its GGUF tensor in that layer
_HEALED_TENSORS = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                   "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                   "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                   "mlp.down_proj.weight": "ffn_down.weight"}
#: the architectures whose healed projections genspec writes into GGUF, and whether llama.cpp's converter
#: reorders their query and key rows (the llama family's interleaved rotary layout; the others keep Hugging
#: Face's order)
_HEALED_ARCHITECTURES = {"llama": True, "gemma3": False, "gemma2": False, "qwen2": False, "qwen3": False}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def pruned_gguf(source: str | os.PathLike, layers: list[int], heads: list[list[int]], channels: list[list[int]],
                weights: str | os.PathLike | None = None, cache: Path | None = None) -> Path:
    """A GGUF copy of ``source`` keeping the ``layers`` and, in layer i, the query heads ``heads[i]`` and the MLP
    channels ``channels[i]`` (a plan of ``genspec calibrate prune``: one list per layer of the source), the
    projections in ``weights`` (the plan's healed weights, a safetensors file) in place of the cut ones. Made once
    and kept in ``cache`` (default: ``$GENSPEC_CACHE/derived``), named by the source, the plan and the weights,
    written under a temporary name first."""
    import gguf

    from genspec.embedded import cache_root

    source = Path(source)
    if not source.is_file():
        raise InputFileError(f"no GGUF model at {source}")
    check_complete(source)
    weights = None if weights is None else Path(weights)
    if weights is not None and not weights.is_file():
        raise InputFileError(f"healed weights not found: {weights}")
    key = hashlib.sha256(repr((_stamp(source), sorted(set(layers)), heads, channels,
                               weights and _stamp(weights), PRUNED_FORMAT)).encode()).hexdigest()[:16]
    folder = Path(cache) if cache is not None else cache_root() / "derived"
    copy = folder / f"{source.stem}-pruned-{key}.gguf"
    if copy.is_file():
        return copy
    folder.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(source))
    cut = _Cut.of(reader, layers, heads, channels)
    healed = _healed_tensors(weights, cut) if weights is not None else {}
    partial = copy.with_suffix(f".{os.getpid()}.partial")
    try:
        requantise = _write(reader, cut, healed, partial)
        if requantise is not None:
            quantised = derived_gguf(partial, requantise, cache=folder)
            os.replace(quantised, copy)
        else:
            os.replace(partial, copy)
    finally:
        partial.unlink(missing_ok=True)
    return copy


def _stamp(path: Path) -> tuple:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


class _Cut:
    """What a plan keeps of a source's layers, checked against the source's shapes."""

    def __init__(self, arch: str, layers: list[int], q_heads: list[list[int]], kv_heads: list[list[int]],
                 channels: list[list[int]], key_length: int, value_length: int):
        self.arch, self.layers = arch, layers
        self.q_heads, self.kv_heads, self.channels = q_heads, kv_heads, channels  # per kept layer, in order
        self.key_length, self.value_length = key_length, value_length

    @classmethod
    def of(cls, reader, layers: list[int], heads: list[list[int]], channels: list[list[int]]) -> "_Cut":
        fields = reader.fields
        arch = str(fields["general.architecture"].contents())

        def number(name: str, default=None) -> int:
            field = fields.get(f"{arch}.{name}")
            if field is None:
                if default is None:
                    raise InputFileError(f"this {arch} GGUF names no {name}: genspec cannot prune it")
                return default
            value = field.contents()
            if isinstance(value, list):  # one per layer: pruned alike, every layer must agree
                if len(set(value)) != 1:
                    raise ConfigError(f"this {arch} GGUF has a different {name} in different layers: genspec "
                                      "prunes GGUF models whose layers are alike")
                value = value[0]
            return int(value)

        total, num_heads = number("block_count"), number("attention.head_count")
        num_kv, num_ff = number("attention.head_count_kv", num_heads), number("feed_forward_length")
        key_length = number("attention.key_length", number("embedding_length") // num_heads)
        value_length = number("attention.value_length", key_length)
        if len(heads) != total or len(channels) != total:
            raise ConfigError(f"a pruning plan needs heads and channels for each of the model's {total} layers, "
                              f"got {len(heads)} and {len(channels)}")
        kept = sorted(set(int(i) for i in layers))
        if not kept or any(not 0 <= i < total for i in kept):
            raise ConfigError(f"a pruning plan keeps layers of 0..{total - 1}, at least one; got {list(layers)}")
        per_group = num_heads // num_kv
        q_heads, kv_heads, kept_channels = [], [], []
        for i in kept:
            q = sorted(set(int(h) for h in heads[i]))
            c = sorted(set(int(x) for x in channels[i]))
            if not q or any(not 0 <= h < num_heads for h in q):
                raise ConfigError(f"layer {i} of the plan keeps heads {heads[i]}: some of 0..{num_heads - 1} needed")
            if not c or any(not 0 <= x < num_ff for x in c):
                raise ConfigError(f"layer {i} of the plan keeps channels outside 0..{num_ff - 1}, or none")
            q_heads.append(q)
            kv_heads.append(sorted({h // per_group for h in q}))
            kept_channels.append(c)
        for name, counts in (("query heads", q_heads), ("key/value heads", kv_heads), ("MLP channels", kept_channels)):
            if len({len(x) for x in counts}) > 1:
                raise ConfigError(f"this pruning plan keeps {sorted({len(x) for x in counts})} {name} in different "
                                  "layers: a GGUF copy names one count for all its layers (make the plan with the "
                                  "same --keep for every layer of a model whose layers are alike)")
        for i, q, kv in zip(kept, q_heads, kv_heads):
            if len({sum(h // per_group == g for h in q) for g in kv}) > 1:
                raise ConfigError(f"layer {i} of this pruning plan keeps more query heads of one key/value head than "
                                  "of another: a GGUF copy's key/value heads each serve as many query heads")
        return cls(arch, kept, q_heads, kv_heads, kept_channels, key_length, value_length)

    def rows(self, role: str, j: int) -> np.ndarray | None:
        """The rows (outputs) kept of layer ``j``'s tensor ``role`` (None: all)."""
        if role.startswith("attn_q."):
            return _span(self.q_heads[j], self.key_length)
        if role.startswith("attn_k."):
            return _span(self.kv_heads[j], self.key_length)
        if role.startswith("attn_v."):
            return _span(self.kv_heads[j], self.value_length)
        if role.startswith(("ffn_gate.", "ffn_up.")):
            return np.asarray(self.channels[j])
        return None

    def columns(self, role: str, j: int) -> np.ndarray | None:
        """The columns (inputs) kept of layer ``j``'s tensor ``role`` (None: all)."""
        if role == "attn_output.weight":
            return _span(self.q_heads[j], self.value_length)
        if role == "ffn_down.weight":
            return np.asarray(self.channels[j])
        return None


def _span(units: list[int], width: int) -> np.ndarray:
    """The rows of ``units`` (heads), ``width`` each: heads [0, 2] of 4 rows are rows 0-3 and 8-11."""
    return (np.asarray(units)[:, None] * width + np.arange(width)[None, :]).reshape(-1)


_FUSED = ("attn_qkv.", "ffn_gate_up.", "ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps.")


def _write(reader, cut: _Cut, healed: dict[str, np.ndarray], path: Path):
    """Write the pruned copy to ``path``; returns the weight type the copy must be requantised to (a quantised
    source some of whose tensors were dequantised to be cut), or None."""
    import gguf

    arch = cut.arch
    writer = gguf.GGUFWriter(str(path), arch=arch, endianess=reader.endianess)
    alignment = reader.fields.get("general.alignment")
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    windows = {"general.architecture": arch, **{name: _contents(reader, name) for name in (
        f"{arch}.block_count", f"{arch}.attention.sliding_window", f"{arch}.attention.sliding_window_pattern")}}
    kept = set(cut.layers)
    dropped = tuple(i for i in range(int(windows[f"{arch}.block_count"])) if i not in kept)
    pattern = kept_window_pattern(windows, dropped)
    changed = {f"{arch}.block_count": len(cut.layers), f"{arch}.attention.head_count": len(cut.q_heads[0]),
               f"{arch}.attention.head_count_kv": len(cut.kv_heads[0]),
               f"{arch}.feed_forward_length": len(cut.channels[0]),
               f"{arch}.attention.key_length": cut.key_length, f"{arch}.attention.value_length": cut.value_length}
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or field.name in changed:
            continue
        if pattern is not None and field.name == f"{arch}.attention.sliding_window_pattern":
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for name, value in changed.items():
        writer.add_uint32(name, value)
    if pattern is not None:
        writer.add_array(f"{arch}.attention.sliding_window_pattern", pattern)

    position = {layer: j for j, layer in enumerate(cut.layers)}
    dequantised = False
    for tensor in reader.tensors:
        match = _BLOCK.fullmatch(tensor.name)
        kind = gguf.GGMLQuantizationType(tensor.tensor_type)
        if match is None:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=kind)
            continue
        layer, role = int(match.group(1)), match.group(2)
        if layer not in position:
            continue
        if role.startswith(_FUSED):
            raise ConfigError(f"this {arch} GGUF holds {role.split('.')[0]} tensors (fused projections or "
                              "experts): genspec prunes the separate q/k/v and gate/up/down projections only")
        j = position[layer]
        name = f"blk.{j}.{role}"
        rows, columns = cut.rows(role, j), cut.columns(role, j)
        float_source = kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        if name in healed:
            values = healed[name]
            dequantised |= not float_source
            writer.add_tensor(name, values.astype(np.float16 if kind is gguf.GGMLQuantizationType.F16
                                                  else np.float32))
        elif rows is None and columns is None:
            writer.add_tensor(name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=kind)
        elif columns is None:  # whole rows: a quantised tensor's bytes kept
            data = np.ascontiguousarray(tensor.data[rows])
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
        else:
            values = tensor.data if float_source else gguf.quants.dequantize(tensor.data, kind)
            if rows is not None:
                values = values[rows]
            values = np.ascontiguousarray(values[..., columns])
            dequantised |= not float_source
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if not dequantised:
        return None
    file_type = _contents(reader, "general.file_type")
    try:
        return GGUFType(gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_"))
    except (TypeError, ValueError):  # a file type genspec does not name: 8 bits, the cut tensors' nearest
        return GGUFType.Q8_0


def _contents(reader, name: str):
    field = reader.fields.get(name)
    return None if field is None else field.contents()


def _healed_tensors(path: Path, cut: _Cut) -> dict[str, np.ndarray]:
    """The healed projections of the weights file ``path`` by their GGUF names in the copy, as llama.cpp's
    converter would have written them."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if cut.arch not in _HEALED_ARCHITECTURES:
        raise ConfigError(f"genspec writes healed weights into GGUF models of {sorted(_HEALED_ARCHITECTURES)}, not "
                          f"{cut.arch}: prune without --heal-steps, or draft on the torch backend")
    try:
        saved = {name: t.float().numpy() for name, t in load_file(str(path)).items()}
    except (OSError, SafetensorError) as exc:
        raise InputFileError(f"cannot read the healed weights {path}: {str(exc).splitlines()[0]}") from exc
    out = {}
    for name, values in saved.items():
        index, _, module = name.partition(".")
        if not index.isdigit() or module not in _HEALED_TENSORS or int(index) >= len(cut.layers):
            raise InputFileError(f"{path} holds the weights of another pruned copy than this plan's ({name})")
        j = int(index)
        role = _HEALED_TENSORS[module]
        if _HEALED_ARCHITECTURES[cut.arch] and role in ("attn_q.weight", "attn_k.weight"):
            values = _interleave_rotary(values, len(cut.q_heads[j] if role == "attn_q.weight" else cut.kv_heads[j]))
        out[f"blk.{j}.{role}"] = values
    return out


def _interleave_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotate-half query / key rows in llama.cpp's interleaved rotary order, as its converter
    writes the llama family: within each head, rows (0, d/2, 1, d/2 + 1, ...)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))
