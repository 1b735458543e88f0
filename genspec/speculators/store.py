"""A trained speculator on disk: a directory with its shape, draft vocabulary, target fingerprint and
training record (head.json) and its weights (head.safetensors), for every kind ``genspec train`` makes."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from genspec.errors import ConfigError, InputFileError
from genspec.speculators.distilled import DraftConfig
from genspec.speculators.head import HeadConfig, head_network
from genspec.speculators.medusa import MedusaConfig, MedusaHeads
from genspec.speculators.recurrent import draft_network


#: the speculator kinds a saved directory may hold, by the ``kind`` in its head.json: (network from its shape,
#: shape); a head's network is the one its shape's ``shape`` names, a draft's the one its ``arch`` names
KINDS = {"head": (head_network, HeadConfig), "medusa": (MedusaHeads, MedusaConfig), "draft": (draft_network, DraftConfig)}


def target_fingerprint(target) -> str:
    """A short hash of what a head depends on in its target: its shapes, trained context and the signs of 64 rows
    of its output layer (a head trained for another model is refused; the same weights in another dtype or on the
    other backend pass: a GGUF file on llama.cpp and its dequantised copy on torch)."""
    digest = hashlib.sha256()
    digest.update(repr(((target.vocab_size, target.hidden_size), target.num_layers, target.trained_context)).encode())
    rows = torch.linspace(0, target.vocab_size - 1, 64).long()
    digest.update((target.output_rows(rows).cpu() > 0).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


#: the files of a saved head (a directory)
HEAD_CONFIG, HEAD_WEIGHTS = "head.json", "head.safetensors"


def save_head(directory, head: nn.Module, vocab_ids: list[int], fingerprint: str, info: dict | None = None) -> None:
    """Write ``head`` to ``directory``: its shape, draft vocabulary, target fingerprint and ``info``
    (how it was trained) in head.json, its weights in head.safetensors."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # float16 on disk: half the size (the shipped head: 6.4 MB instead of 12.8); the head runs in the
    # target's dtype whatever it was stored in
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in head.state_dict().items()},
              str(directory / HEAD_WEIGHTS))
    (directory / HEAD_CONFIG).write_text(json.dumps({"kind": head.kind, "config": head.config.as_dict(),
                                                     "fingerprint": fingerprint,
                                                     "vocab_ids": list(map(int, vocab_ids)), "info": info or {}}))


def load_head(directory, kind: str = "head") -> tuple[nn.Module, list[int], str, dict]:
    """``(head, vocab_ids, fingerprint, info)`` of a directory written by :func:`save_head`, which must
    hold a speculator of ``kind``."""
    directory = Path(directory)
    if not (directory / HEAD_CONFIG).is_file() or not (directory / HEAD_WEIGHTS).is_file():
        raise InputFileError(f"no trained {kind} at {directory}: expected {HEAD_CONFIG} and {HEAD_WEIGHTS} "
                             f"(written by genspec train {kind})")
    try:
        meta = json.loads((directory / HEAD_CONFIG).read_text())
        saved = meta.get("kind", "head")
        if saved != kind:
            raise ConfigError(f"{directory} holds a trained {saved}, not a {kind}: use --drafter {saved}")
        module, config = KINDS[kind]
        head = module(config(**meta["config"]))
        head.load_state_dict(load_file(str(directory / HEAD_WEIGHTS)))
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as exc:
        raise InputFileError(f"cannot read the trained {kind} at {directory}: {str(exc).splitlines()[0]}") from exc
    return head.eval(), meta["vocab_ids"], meta["fingerprint"], meta.get("info", {})
