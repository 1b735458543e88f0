"""The llama.cpp settings that exactness_probe.py and exact_config_cost.py vary, as command-line options.

``--tiled`` sets ``GGML_CPU_TILED_MM`` (off) or ``GGML_CPU_TILED_MM_FORCE`` (force) in this process's
environment: llama.cpp reads it once, at the first matrix product, so :func:`apply` runs before any model
loads. ``--kv-type`` is the model's :class:`~genspec.models.llamacpp.KVCacheType`. The model is built with
fast kernels (``Kernels.FAST``), which leave each setting as given: the exact ones are these settings together.
"""
import argparse
import os

from genspec.models.llamacpp import Kernels, KVCacheType

_TILED = {"off": ("GGML_CPU_TILED_MM", "0"), "force": ("GGML_CPU_TILED_MM_FORCE", "1")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fa", type=int, default=1, help="flash attention (1) or not (0)")
    parser.add_argument("--kv-type", choices=[t.name.lower() for t in KVCacheType], default="f16")
    parser.add_argument("--tiled", choices=("default", *_TILED), default="default")


def apply(args) -> dict:
    """Set the tiled-matmul switch; the model options for the rest."""
    if args.tiled in _TILED:
        name, value = _TILED[args.tiled]
        os.environ[name] = value
    return {"flash_attention": bool(args.fa), "kv_cache_type": KVCacheType[args.kv_type.upper()],
            "kernels": Kernels.FAST}
