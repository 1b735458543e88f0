"""An EAGLE-3 head (:class:`genspec.speculators.head.Eagle3Head`) written out for other engines:

- :func:`export_gguf`: a GGUF file of llama.cpp's ``eagle3`` architecture, which ``llama-server -m TARGET.gguf
  -md HEAD.gguf --spec-type draft-eagle3`` drafts with. The keys are those llama.cpp's loader reads, with the types
  it checks (integers UINT32, floats FLOAT32, flags BOOL); the tokenizer is the target GGUF's, copied key by key
  (the draft loads its own vocabulary, and nothing checks that it matches); q / k rows are permuted to llama.cpp's
  rotary layout, as its converter does; ``d2t`` holds absolute target ids (I64). No embedding is written: the
  server hands the draft the target's.
- :func:`export_speculators`: a ``speculators``-format checkpoint directory (config.json + model.safetensors), the
  layout vLLM's ``speculators`` config loader and its ``Eagle3LlamaForCausalLM`` read; ``d2t`` there is an offset
  table (``target id - draft index``) and ``t2d`` a bool mask over the target's vocabulary.
  :func:`load_speculators` reads one back into a head.

llama.cpp's EAGLE-3 reads the inputs of three target layers, which only some of its architectures' graphs record
(:data:`LAYER_INPUT_ARCHS`); Gemma 3's does not, so a Gemma 3 target cannot draft with it in llama.cpp.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from genspec.errors import ConfigError, InputFileError
from genspec.speculators.head import Eagle3Head, HeadConfig, HeadNetwork, HeadShape

#: the architectures whose graph, in the llama.cpp genspec builds against, records its layers' inputs (what its
#: EAGLE-3 reads from the target); any other aborts once EAGLE-3 is on (gemma3's and qwen2's among them)
LAYER_INPUT_ARCHS = ("llama", "llama-embed", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe", "gemma4",
                     "gpt-oss", "lfm2")

#: each weight of an EAGLE-3 head: (its name in the head's state dict, in a speculators checkpoint, in llama.cpp's
#: GGUF, the heads its rows are permuted by for llama.cpp's rotary layout: "q", "kv" or "")
TENSORS = (
    ("fc.weight", "fc.weight", "fc.weight", ""),
    ("layers.0.input_layernorm.weight", "layers.0.input_layernorm.weight", "blk.0.attn_norm.weight", ""),
    ("layers.0.hidden_norm.weight", "layers.0.hidden_norm.weight", "blk.0.attn_norm_2.weight", ""),
    ("layers.0.q_proj.weight", "layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", "q"),
    ("layers.0.k_proj.weight", "layers.0.self_attn.k_proj.weight", "blk.0.attn_k.weight", "kv"),
    ("layers.0.v_proj.weight", "layers.0.self_attn.v_proj.weight", "blk.0.attn_v.weight", ""),
    ("layers.0.o_proj.weight", "layers.0.self_attn.o_proj.weight", "blk.0.attn_output.weight", ""),
    ("layers.0.post_attention_layernorm.weight", "layers.0.post_attention_layernorm.weight", "blk.0.ffn_norm.weight", ""),
    ("layers.0.gate_proj.weight", "layers.0.mlp.gate_proj.weight", "blk.0.ffn_gate.weight", ""),
    ("layers.0.up_proj.weight", "layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight", ""),
    ("layers.0.down_proj.weight", "layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight", ""),
    ("norm.weight", "norm.weight", "output_norm.weight", ""),
    ("lm_head.weight", "lm_head.weight", "output.weight", ""),
)
#: a speculators checkpoint's files
SPECULATORS_CONFIG, SPECULATORS_WEIGHTS = "config.json", "model.safetensors"
#: the draft length a speculators checkpoint proposes by default (its ``proposal_methods``; vLLM's
#: ``num_speculative_tokens`` unless given)
SPECULATIVE_TOKENS = 3


def require_eagle3(head: HeadNetwork, where: str = "the head") -> None:
    if not isinstance(head, Eagle3Head):
        raise ConfigError(f"{where} is not EAGLE-3 shaped (its shape is {head.config.shape}); only a head trained with "
                          f"genspec train head --shape {HeadShape.EAGLE3} exports to llama.cpp or vLLM")


def check_vocabulary(head: HeadNetwork, vocab_ids: list[int], target_tokens: int) -> None:
    """Refuse a draft vocabulary that is not ``head``'s size in distinct ids below the target's ``target_tokens``."""
    ids = [int(i) for i in vocab_ids]
    if len(ids) != head.config.vocab_size or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= target_tokens:
        raise ConfigError(f"the head's vocabulary must be {head.config.vocab_size} distinct ids below the target's "
                          f"{target_tokens} tokens")


def permute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """q / k rows from HF's rotate-half rotary layout to llama.cpp's interleaved one (its converter's ``permute``)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _reader(path: Path):
    import gguf

    if not Path(path).is_file():
        raise InputFileError(f"no target GGUF at {path}")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise InputFileError(f"cannot read {path} as GGUF: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc


def _field(reader, key: str, path: Path):
    field = reader.get_field(key)
    if field is None:
        raise InputFileError(f"{path} has no {key}")
    return field.contents()


def export_gguf(head: HeadNetwork, vocab_ids: list[int], target_gguf: str | Path, out: str | Path) -> Path:
    """Write ``head`` (an :class:`Eagle3Head`, its vocabulary ``vocab_ids``) as llama.cpp's ``eagle3`` GGUF at
    ``out`` for the target in ``target_gguf`` (its tokenizer and context are copied; its architecture must record
    layer inputs, :data:`LAYER_INPUT_ARCHS`; its width and layers must be the head's)."""
    import gguf

    require_eagle3(head)
    target_gguf, out = Path(target_gguf), Path(out)
    reader = _reader(target_gguf)
    arch = _field(reader, "general.architecture", target_gguf)
    if arch not in LAYER_INPUT_ARCHS:
        raise ConfigError(f"llama.cpp's EAGLE-3 needs a target architecture whose graph records layer inputs "
                          f"({', '.join(LAYER_INPUT_ARCHS[:3])}, ...); {target_gguf} is {arch}, whose graph does not")
    config = head.config
    width, layers = _field(reader, f"{arch}.embedding_length", target_gguf), _field(reader, f"{arch}.block_count", target_gguf)
    if width != config.hidden_size:
        raise ConfigError(f"the head is {config.hidden_size} wide, the target in {target_gguf} {width}: another model")
    if not all(0 <= layer < layers for layer in config.feature_layers):
        raise ConfigError(f"the head reads target layers {list(config.feature_layers)}; {target_gguf} has {layers}")
    tokens = len(_field(reader, "tokenizer.ggml.tokens", target_gguf))
    check_vocabulary(head, vocab_ids, tokens)
    ids = np.asarray(vocab_ids, dtype=np.int64)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "eagle3")
    writer.add_name("genspec EAGLE-3 head")
    writer.add_context_length(int(_field(reader, f"{arch}.context_length", target_gguf)))
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(1)  # llama.cpp's eagle3 graph asserts one layer
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(float(config.eps))
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(tokens)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    # python ints: gguf infers an INT32 array from them (numpy integers it refuses)
    writer.add_array("eagle3.target_layers", [int(layer) for layer in config.feature_layers])
    writer.add_uint32("eagle3.target_hidden_size", width)
    writer.add_bool("eagle3.norm_before_residual", False)
    writer.add_bool("eagle3.norm_before_fc", False)
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    state = {name: tensor.detach().float().cpu().numpy() for name, tensor in head.state_dict().items()}
    heads = {"q": config.num_heads, "kv": config.num_kv_heads}
    for own, _, name, permuted in TENSORS:
        values = state[own]
        writer.add_tensor(name, np.ascontiguousarray(permute_rotary(values, heads[permuted]) if permuted else values))
    if len(ids) != tokens or (ids != np.arange(tokens)).any():
        writer.add_tensor("d2t", ids)  # absolute target ids; none needed when the draft vocabulary is the target's, in order
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def export_speculators(head: HeadNetwork, vocab_ids: list[int], out: str | Path, target_vocab_size: int,
                       verifier: str, verifier_architectures: list[str] | None = None, max_positions: int = 8192,
                       speculative_tokens: int = SPECULATIVE_TOKENS) -> Path:
    """Write ``head`` as a speculators ``eagle3`` checkpoint in directory ``out`` for a target of
    ``target_vocab_size`` tokens (``verifier``: its name or path, as vLLM's ``speculators_config.verifier`` names
    it). The draft vocabulary is stored in ascending target-id order (what ``t2d`` selects), its output rows with it."""
    from transformers import LlamaConfig

    require_eagle3(head)
    config = head.config
    check_vocabulary(head, vocab_ids, target_vocab_size)
    ids = torch.as_tensor(vocab_ids, dtype=torch.long)
    order = ids.argsort()
    state = {name: tensor.detach().float().cpu() for name, tensor in head.state_dict().items()}
    tensors = {theirs: state[own] for own, theirs, _, _ in TENSORS}
    tensors["lm_head.weight"] = tensors["lm_head.weight"][order]
    ids = ids[order]
    tensors["d2t"] = ids - torch.arange(len(ids))
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    layer = LlamaConfig(vocab_size=target_vocab_size, hidden_size=config.hidden_size,
                        intermediate_size=config.intermediate_size, num_hidden_layers=1,
                        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                        head_dim=config.head_dim, hidden_act="silu", max_position_embeddings=max_positions,
                        rms_norm_eps=config.eps, rope_theta=config.rope_theta, tie_word_embeddings=False,
                        attention_bias=False, mlp_bias=False)
    meta = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer.to_dict(),
        "draft_vocab_size": config.vocab_size,
        # written out: vLLM takes a missing norm_before_residual as true
        "norm_before_residual": False,
        "norm_before_fc": False,
        "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier), "architectures": list(verifier_architectures or [])},
        },
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(out / SPECULATORS_WEIGHTS))
    (out / SPECULATORS_CONFIG).write_text(json.dumps(meta, indent=2, default=str))
    return out


def load_speculators(directory: str | Path) -> tuple[Eagle3Head, list[int]]:
    """``(head, vocab_ids)`` of a speculators ``eagle3`` checkpoint (one :func:`export_speculators` writes, or
    another of the same layout: no norm before the residual or before ``fc``, three target layers)."""
    from transformers import LlamaConfig

    directory = Path(directory)
    if not (directory / SPECULATORS_CONFIG).is_file() or not (directory / SPECULATORS_WEIGHTS).is_file():
        raise InputFileError(f"no speculators checkpoint at {directory}: expected {SPECULATORS_CONFIG} and "
                             f"{SPECULATORS_WEIGHTS}")
    try:
        meta = json.loads((directory / SPECULATORS_CONFIG).read_text())
        tensors = load_file(str(directory / SPECULATORS_WEIGHTS))
    except (ValueError, OSError) as exc:
        raise InputFileError(f"cannot read the speculators checkpoint at {directory}: {str(exc).splitlines()[0]}") from exc
    if meta.get("speculators_model_type") != "eagle3":
        raise ConfigError(f"{directory} holds a speculators {meta.get('speculators_model_type')!r} checkpoint, not eagle3")
    if meta.get("norm_before_residual", True) or meta.get("norm_before_fc", False):
        raise ConfigError(f"{directory} normalises before the residual or before fc, which genspec's EAGLE-3 head does not")
    layer = LlamaConfig(**meta["transformer_layer_config"])
    rope = getattr(layer, "rope_theta", None) or (layer.rope_parameters or {}).get("rope_theta", 10_000.0)
    config = HeadConfig(hidden_size=layer.hidden_size, num_heads=layer.num_attention_heads,
                        num_kv_heads=layer.num_key_value_heads,
                        head_dim=getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads,
                        intermediate_size=layer.intermediate_size, num_layers=1, rope_theta=float(rope),
                        eps=float(layer.rms_norm_eps), feature_layers=tuple(meta["eagle_aux_hidden_state_layer_ids"]),
                        shape=HeadShape.EAGLE3, vocab_size=int(meta["draft_vocab_size"]))
    head = Eagle3Head(config)
    try:
        tensors = {name.replace("midlayer.", "layers.0."): tensor for name, tensor in tensors.items()}
        head.load_state_dict({own: tensors[theirs] for own, theirs, _, _ in TENSORS})
        d2t = tensors["d2t"].long()
    except (KeyError, RuntimeError) as exc:
        raise InputFileError(f"the speculators checkpoint at {directory} lacks or misshapes a tensor: "
                             f"{str(exc).splitlines()[0]}") from exc
    return head.eval(), (torch.arange(len(d2t)) + d2t).tolist()
