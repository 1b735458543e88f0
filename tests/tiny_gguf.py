"""Tiny GGUF files written in the test (no download): a random-weight Llama from ``tiny_models.tiny_llama``
exported the way llama.cpp's converter does (q / k rows permuted to its rotary layout), with the byte-level
vocabulary of ``tiny_models.byte_tokenizer`` as a GPT-2 style tokenizer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tiny_models import byte_tokenizer, peaked, tiny_llama


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half q / k rows to llama.cpp's interleaved rotary layout (its converter's ``permute``)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_tiny_gguf(path: Path, seed: int = 0, layers: int = 2, hidden: int = 64, context: int = 256,
                    scale: float = 1.0, vocab: int | None = None, weight_type: str = "F32"):
    """Write a tiny Llama GGUF (float32 weights) to ``path``; returns ``(hf_model, tokenizer)``, the same
    function in transformers (float32) and the byte tokenizer its vocabulary matches. ``scale`` sharpens
    the next-token laws (see ``tiny_models.peaked``). With ``vocab`` (for exact laws over few tokens) the
    vocabulary is ``vocab`` made-up tokens and the tokenizer None. Either vocabulary ends with the result of
    its one BPE merge (the byte tokenizer never produces it). ``weight_type``: as :func:`write_llama_gguf`."""
    if vocab is None:
        tokenizer = byte_tokenizer()
        pieces = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
        pieces.append(pieces[3] + pieces[4])  # the one merge's result (llama.cpp wants merges, transformers their results)
    else:
        tokenizer = None
        pieces = made_up_pieces(vocab)
    model = tiny_llama(seed, vocab=len(pieces), layers=layers, hidden=hidden, dtype=torch.float32, context=context)
    if scale != 1.0:
        peaked(model, scale)
    write_llama_gguf(path, model, pieces, weight_type)
    return model, tokenizer


def made_up_pieces(vocab: int) -> list[str]:
    """A GGUF vocabulary of ``vocab`` made-up tokens (``<pad> <bos> <eos>``, letters, and its one merge's result
    last), for a model whose tokenizer is not the GGUF's (a test hands its own to ``LlamaCppLM``) or is none."""
    pieces = ["<pad>", "<bos>", "<eos>"] + [chr(ord("a") + i) for i in range(vocab - 4)]
    return pieces + [pieces[3] + pieces[4]]


def write_llama_gguf(path: Path, model, pieces: list[str], weight_type: str = "F32", metadata: dict | None = None) -> None:
    """Write the transformers Llama ``model`` to ``path`` as llama.cpp's converter would, with ``pieces`` (one per
    token id, the last the result of merging the fourth and fifth) as a GPT-2 style vocabulary. ``weight_type`` (a
    ``gguf.GGMLQuantizationType`` name that gguf-py can write: F32, F16, BF16, Q8_0, Q5_0, Q4_0, ...) stores the
    matrices so, the norms in F32; the transformers model then computes the unquantised function. ``metadata``: more
    keys, each a value gguf-py writes as it infers its type (a Python int as INT32, a list of bools as a BOOL
    array)."""
    import gguf

    config = model.config
    hidden, layers, context = config.hidden_size, config.num_hidden_layers, config.max_position_embeddings
    assert len(pieces) == config.vocab_size
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("genspec-tiny-llama")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(hidden // config.num_attention_heads)
    writer.add_vocab_size(len(pieces))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_types([gguf.TokenType.CONTROL if token.startswith("<") and len(token) > 1
                            else gguf.TokenType.NORMAL for token in pieces])
    writer.add_token_merges([f"{pieces[3]} {pieces[4]}"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_add_bos_token(False)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value),
                             sub_type=gguf.GGUFValueType.get_type(value[0]) if isinstance(value, list) else None)

    state = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    kind = gguf.GGMLQuantizationType[weight_type]

    def add(name: str, tensor: torch.Tensor) -> None:
        values = np.ascontiguousarray(tensor.numpy().astype(np.float32))
        if values.ndim < 2 or kind is gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        add(f"blk.{layer}.attn_norm.weight", state[prefix + "input_layernorm.weight"])
        add(f"blk.{layer}.attn_q.weight", _permute(state[prefix + "self_attn.q_proj.weight"], heads))
        add(f"blk.{layer}.attn_k.weight", _permute(state[prefix + "self_attn.k_proj.weight"], kv_heads))
        add(f"blk.{layer}.attn_v.weight", state[prefix + "self_attn.v_proj.weight"])
        add(f"blk.{layer}.attn_output.weight", state[prefix + "self_attn.o_proj.weight"])
        add(f"blk.{layer}.ffn_norm.weight", state[prefix + "post_attention_layernorm.weight"])
        add(f"blk.{layer}.ffn_gate.weight", state[prefix + "mlp.gate_proj.weight"])
        add(f"blk.{layer}.ffn_up.weight", state[prefix + "mlp.up_proj.weight"])
        add(f"blk.{layer}.ffn_down.weight", state[prefix + "mlp.down_proj.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
