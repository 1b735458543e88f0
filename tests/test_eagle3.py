"""The EAGLE-3 head in llama.cpp's layout (:class:`genspec.speculators.head.Eagle3Head`): it trains on a tiny
Llama's own continuations, drafts losslessly through :class:`genspec.drafters.head.HeadDrafter`, exports as
llama.cpp's ``eagle3`` GGUF (which llama.cpp loads, and llama-server drafts with, accepting exactly what genspec
accepts) and as a speculators checkpoint (vLLM's names and shapes; read back, the same logits)."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from stats_helpers import lossless_pvalue
from tiny_gguf import write_tiny_gguf

from genspec.bench import llama_server
from genspec.drafters.head import HeadDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError, InputFileError
from genspec.models import HFCausalLM
from genspec.sampling import SamplingConfig
from genspec.speculators.export import (
    LAYER_INPUT_ARCHS,
    SPECULATORS_CONFIG,
    SPECULATORS_WEIGHTS,
    export_gguf,
    export_speculators,
    load_speculators,
    permute_rotary,
)
from genspec.speculators.head import DraftHead, Eagle3Head, HeadConfig, HeadShape
from genspec.speculators.store import load_head
from genspec.train.data import choose_vocabulary, record_features
from genspec.train.loop import resumable_state, train_head
from genspec.train.settings import TrainSettings

LAYERS = (1, 2, 3)  # of a 4-layer target: the inputs of its layers 1, 2 and 3
SHAPE = HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                   feature_layers=LAYERS, shape=HeadShape.EAGLE3, vocab_size=48)
#: prompts the head was not trained on (the training prompts are random 4-token ones) whose greedy continuations
#: hold no end-of-sequence token (llama-server's ignore_eos forbids it; genspec's eos_token_ids=() does not)
PROMPTS = [[7, 100, 7, 100, 7], [99, 98, 97]]
NEW_TOKENS = 40


def _continuations(target, count: int = 32, length: int = 48, seed: int = 1) -> list[list[int]]:
    """The target's greedy continuations of random 4-token prompts: what ``genspec train head`` trains on."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 259, (4,), generator=generator).tolist() for _ in range(count)]
    results = SpeculativeEngine(target).generate_ids(prompts, max_new_tokens=length, temperature=0.0, eos_token_ids=())
    return [p + r.token_ids for p, r in zip(prompts, results)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(directory, target GGUF path, HF target, head, vocab_ids): a tiny 4-layer float32 Llama written as GGUF and
    an EAGLE-3 head trained briefly on its own continuations, through genspec's training loop and store."""
    root = tmp_path_factory.mktemp("eagle3")
    model, tokenizer = write_tiny_gguf(root / "target.gguf", seed=0, layers=4, scale=4.0)
    target = HFCausalLM(model, tokenizer)
    sequences = _continuations(target)
    vocab = choose_vocabulary(sequences, SHAPE.vocab_size)
    config = HeadConfig(**{**SHAPE.as_dict(), "vocab_size": len(vocab)})
    data = record_features(target, sequences, feature_layers=LAYERS)
    settings = TrainSettings(steps=150, batch_size=8, sequence_length=64, learning_rate=3e-3, warmup=10,
                             checkpoint_every=150, held_out_every=0)
    log = train_head(target, data[:-4], data[-4:], vocab, root / "head", config=config, settings=settings)
    head, vocab_ids, _, _ = load_head(root / "head")
    return root, root / "target.gguf", target, head, vocab_ids, log


def test_an_eagle3_shape_takes_three_layers_one_layer_and_its_vocabulary():
    for bad in ({"feature_layers": (1, 2)}, {"num_layers": 2}, {"token_layers": 1}, {"vocab_size": 0}):
        with pytest.raises(ConfigError, match="EAGLE-3 head"):
            HeadConfig(**{**SHAPE.as_dict(), **bad})
    with pytest.raises(ConfigError, match="shape is one of eagle, eagle3"):
        HeadConfig(hidden_size=64, shape="medusa")
    head = Eagle3Head(SHAPE)
    assert head.fc.in_features == 3 * 64 and head.layers[0].q_proj.in_features == 2 * 64
    assert head.lm_head.out_features == 48 and not head.predicts_features and DraftHead(HeadConfig(64)).predicts_features


def test_training_teaches_the_head_its_targets_next_tokens(trained):
    root, _, _, head, vocab_ids, log = trained
    assert isinstance(head, Eagle3Head) and head.config.feature_layers == LAYERS and len(vocab_ids) == head.config.vocab_size
    assert all(entry["regression"] == 0 for entry in log["loss"])  # its own states: no feature regression
    assert log["held_out_after"]["agreement"] > log["held_out_before"]["agreement"] + 0.2
    # its checkpoint holds plain data only (the shape by name), so training can resume from it
    assert resumable_state(root / "head", head.config)["step"] == 150


@pytest.mark.parametrize("tree_nodes", [0, 4])
def test_greedy_drafting_with_an_eagle3_head_equals_plain_decoding(trained, tree_nodes):
    _, _, target, head, vocab_ids, _ = trained
    drafter = HeadDrafter(target, head, vocab_ids, tree_nodes=tree_nodes, prompt_states=None)
    assert drafter.capabilities.target_hidden_layers == LAYERS
    plain = SpeculativeEngine(target).generate_ids(PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    spec = SpeculativeEngine(target, drafter).generate_ids(PROMPTS, max_new_tokens=NEW_TOKENS, num_draft_tokens=3,
                                                           draft_length="fixed", eos_token_ids=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.accepted_tokens for s in spec) > 0


def _gguf_fields(path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    return reader, {f.name: f for f in reader.fields.values()}


@pytest.mark.parametrize("tree_nodes, seed", [(0, 51), pytest.param(6, 52, marks=pytest.mark.slow)])
def test_eagle3_head_sampling_is_lossless(tree_nodes, seed):
    """Chi-square of the joint law of the first 3 generated tokens against the exact target law (temperature 0.7,
    top-k 8, top-p 0.9 on draft and target alike; N = 20,000, cells with expected count < 5 pooled; fail if
    p < 1e-3): an untrained EAGLE-3 head over 8 of a 4-layer target's 12 tokens, reading its layers 1-3, its own
    output layer's law handed to the verifier (sampled chains) or deterministic trees of 6 nodes."""
    config = HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                        feature_layers=LAYERS, shape=HeadShape.EAGLE3, vocab_size=8)
    torch.manual_seed(seed)
    head = Eagle3Head(config).to(torch.float64)
    pvalue, acceptance = lossless_pvalue(
        lambda target: HeadDrafter(target, head, list(range(8)), tree_nodes=tree_nodes, tree_top_k=3),
        SamplingConfig(temperature=0.7, top_k=8, top_p=0.9), seed=seed, layers=4)
    assert 0.02 < acceptance < 0.95
    assert pvalue > 1e-3


def test_the_gguf_has_llama_cpps_eagle3_keys_types_and_tensors(trained, tmp_path):
    import gguf

    _, target_path, _, head, vocab_ids, _ = trained
    out = export_gguf(head, vocab_ids, target_path, tmp_path / "eagle3.gguf")
    reader, fields = _gguf_fields(out)
    _, target_fields = _gguf_fields(target_path)
    types = gguf.GGUFValueType
    assert fields["general.architecture"].contents() == "eagle3"
    expected = {"eagle3.block_count": (types.UINT32, 1), "eagle3.embedding_length": (types.UINT32, 64),
                "eagle3.target_hidden_size": (types.UINT32, 64), "eagle3.feed_forward_length": (types.UINT32, 128),
                "eagle3.attention.head_count": (types.UINT32, 4), "eagle3.attention.head_count_kv": (types.UINT32, 2),
                "eagle3.context_length": (types.UINT32, 256), "eagle3.norm_before_residual": (types.BOOL, False),
                "eagle3.norm_before_fc": (types.BOOL, False), "eagle3.rope.dimension_count": (types.UINT32, 16)}
    for key, (kind, value) in expected.items():
        assert fields[key].types == [kind] and fields[key].contents() == value, key
    assert fields["eagle3.attention.layer_norm_rms_epsilon"].types == [types.FLOAT32]
    assert fields["eagle3.target_layers"].types == [types.ARRAY, types.INT32]
    assert fields["eagle3.target_layers"].contents() == list(LAYERS)
    tokenizer_keys = sorted(k for k in target_fields if k.startswith("tokenizer."))
    assert tokenizer_keys and sorted(k for k in fields if k.startswith("tokenizer.")) == tokenizer_keys
    for key in tokenizer_keys:
        assert fields[key].types == target_fields[key].types and fields[key].contents() == target_fields[key].contents()
    tensors = {t.name: t for t in reader.tensors}
    assert "t2d" not in tensors and "token_embd.weight" not in tensors
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert tensors["d2t"].data.tolist() == vocab_ids  # absolute target ids
    assert list(tensors["fc.weight"].shape) == [3 * 64, 64] and list(tensors["blk.0.attn_q.weight"].shape) == [128, 64]
    assert list(tensors["output.weight"].shape) == [64, len(vocab_ids)]
    q = head.layers[0].q_proj.weight.detach().numpy()
    assert np.array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data), permute_rotary(q, 4))
    assert not np.array_equal(permute_rotary(q, 4), q)


def test_llama_cpp_loads_the_gguf(trained, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    _, target_path, _, head, vocab_ids, _ = trained
    out = export_gguf(head, vocab_ids, target_path, tmp_path / "eagle3.gguf")
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(out).encode(), params)
    assert model is not None  # every key and tensor shape checked by llama.cpp's loader
    llama_cpp.llama_model_free(model)


def test_export_refuses_what_llama_cpp_cannot_run(trained, tmp_path):
    import gguf

    _, target_path, _, head, vocab_ids, _ = trained
    with pytest.raises(ConfigError, match="not EAGLE-3 shaped"):
        export_gguf(DraftHead(HeadConfig(64)), vocab_ids, target_path, tmp_path / "x.gguf")
    with pytest.raises(InputFileError, match="no target GGUF"):
        export_gguf(head, vocab_ids, tmp_path / "missing.gguf", tmp_path / "x.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma3")
    writer.add_embedding_length(64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="records layer inputs .*gemma3"):
        export_gguf(head, vocab_ids, tmp_path / "gemma.gguf", tmp_path / "x.gguf")
    assert "gemma3" not in LAYER_INPUT_ARCHS and "llama" in LAYER_INPUT_ARCHS
    with pytest.raises(ConfigError, match="distinct ids"):
        export_gguf(head, vocab_ids[:-1] + vocab_ids[:1], target_path, tmp_path / "x.gguf")


def test_the_speculators_checkpoint_has_vllms_names_and_reads_back(trained, tmp_path):
    _, _, target, head, vocab_ids, _ = trained
    out = export_speculators(head, vocab_ids, tmp_path / "spec", target.vocab_size, verifier="tiny-llama",
                             verifier_architectures=["LlamaForCausalLM"], max_positions=256)
    meta = json.loads((out / SPECULATORS_CONFIG).read_text())
    assert meta["speculators_model_type"] == "eagle3" and meta["architectures"] == ["Eagle3Speculator"]
    assert meta["draft_vocab_size"] == len(vocab_ids) and meta["target_hidden_size"] == 64
    assert meta["eagle_aux_hidden_state_layer_ids"] == list(LAYERS) and meta["norm_before_residual"] is False
    layer = meta["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["hidden_size"], layer["vocab_size"]) == (
        "llama", 1, 64, target.vocab_size)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (4, 2, 16)
    spec = meta["speculators_config"]
    assert spec["verifier"]["name_or_path"] == "tiny-llama" and spec["proposal_methods"][0]["speculative_tokens"] >= 1
    tensors = load_file(str(out / SPECULATORS_WEIGHTS))
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    vd, vt = len(vocab_ids), target.vocab_size
    assert shapes == {"fc.weight": (64, 192), "layers.0.hidden_norm.weight": (64,),
                      "layers.0.input_layernorm.weight": (64,), "layers.0.post_attention_layernorm.weight": (64,),
                      "layers.0.self_attn.q_proj.weight": (64, 128), "layers.0.self_attn.k_proj.weight": (32, 128),
                      "layers.0.self_attn.v_proj.weight": (32, 128), "layers.0.self_attn.o_proj.weight": (64, 64),
                      "layers.0.mlp.gate_proj.weight": (128, 64), "layers.0.mlp.up_proj.weight": (128, 64),
                      "layers.0.mlp.down_proj.weight": (64, 128), "norm.weight": (64,), "lm_head.weight": (vd, 64),
                      "d2t": (vd,), "t2d": (vt,)}
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    ordered = sorted(vocab_ids)
    assert (torch.arange(vd) + tensors["d2t"]).tolist() == ordered  # offsets, over the ids in ascending order
    assert torch.nonzero(tensors["t2d"]).flatten().tolist() == ordered
    back, back_ids = load_speculators(out)
    assert back_ids == ordered and back.config == head.config
    features = torch.randn(2, 5, 4 * 64, generator=torch.Generator().manual_seed(0))
    embeddings = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = head(features, embeddings, own_predictions=True), back(features, embeddings, own_predictions=True)
        for a, b in zip(ours, theirs):
            full_a = torch.full((2, 5, vt), -torch.inf)
            full_b = torch.full((2, 5, vt), -torch.inf)
            full_a[..., vocab_ids] = head.draft_logits(a, None)
            full_b[..., back_ids] = back.draft_logits(b, None)
            assert torch.allclose(full_a, full_b, atol=1e-6)
    with pytest.raises(InputFileError, match="no speculators checkpoint"):
        load_speculators(tmp_path / "nowhere")


def _binary():
    """The llama-server binary genspec would run (``$GENSPEC_LLAMA_SERVER`` or the cached build), or None."""
    named = os.environ.get("GENSPEC_LLAMA_SERVER")
    try:
        cached = llama_server.build_dir() / "bin" / "llama-server"
    except ConfigError:  # no llama-cpp-python: nothing was built against it
        return None
    return named if named else (cached if cached.is_file() else None)


class _Recording(HeadDrafter):
    """A head drafter that records, per proposal, the committed length and the chain it drafted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.proposals: list[tuple[int, list[int]]] = []

    def propose(self, requests):
        draft = super().propose(requests)
        for i, request in enumerate(requests):
            self.proposals.append((len(request.sequence), draft.chains(i)[0] if draft.chains(i) else []))
        return draft


def _genspec_steps(target, head, vocab_ids, prompt: list[int]) -> tuple[list[int], list[int]]:
    """genspec's greedy tokens and, per drafting step, whether its one draft token was kept (a chain of 1), on
    llama-server's schedule: the server samples the first token from its prefill without a draft (genspec's engine
    drafts it), so genspec starts from the prompt and that token; and the server drafts at most one token fewer than
    remain, so genspec's draft when a single token remains is left out."""
    first = SpeculativeEngine(target).generate_ids([prompt], max_new_tokens=1, eos_token_ids=())[0].token_ids
    context = prompt + first
    drafter = _Recording(target, head, vocab_ids, tree_nodes=0, prompt_states=None)
    result = SpeculativeEngine(target, drafter).generate_ids([context], max_new_tokens=NEW_TOKENS - 1,
                                                             num_draft_tokens=1, draft_length="fixed",
                                                             eos_token_ids=())[0]
    sequence, last = context + result.token_ids, len(context) + NEW_TOKENS - 2
    steps = [int(sequence[length] == chain[0]) for length, chain in drafter.proposals if chain]
    assert len(steps) == result.stats.drafted_tokens and sum(steps) == result.stats.accepted_tokens
    kept = [int(sequence[length] == chain[0]) for length, chain in drafter.proposals if chain and length < last]
    assert len(steps) - len(kept) <= 1
    return first + result.token_ids, kept


def test_llama_server_drafts_with_the_gguf_and_accepts_what_genspec_accepts(trained, tmp_path, monkeypatch):
    """llama-server, target GGUF + exported head (``--spec-type draft-eagle3``, one draft token, greedy), keeps at
    every step the draft token genspec's drafter keeps over the same weights on torch: same tokens, same steps."""
    binary = _binary()
    if binary is None:
        pytest.skip("no llama-server built (GENSPEC_LLAMA_SERVER, or genspec bench builds it)")
    _, target_path, target, head, vocab_ids, _ = trained
    draft = export_gguf(head, vocab_ids, target_path, tmp_path / "eagle3.gguf")
    monkeypatch.setenv("LLAMA_TRACE", "1")  # llama-server logs each step's accepted draft tokens
    flags = ("-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", "1", "--spec-draft-n-min", "0",
             "--spec-draft-p-min", "0")
    with llama_server.LlamaServer(target_path, context=256, threads=1, extra=flags, binary=binary) as server:
        for prompt in PROMPTS:
            tokens, steps = _genspec_steps(target, head, vocab_ids, prompt)
            start = server.log.tell()
            out = server.complete(prompt, NEW_TOKENS, {"temperature": 0.0, "top_k": 1, "ignore_eos": True})
            server.log.seek(start)
            log = server.log.read()
            assert [int(t) for t in out["tokens"]] == tokens
            timings = out["timings"]
            assert (timings["draft_n"], timings["draft_n_accepted"]) == (len(steps), sum(steps)), (timings, steps)
            logged = [int(a) for a, _ in re.findall(r"accepted\s+(\d+)/\s*(\d+) draft tokens$", log, re.MULTILINE)]
            assert logged == steps  # step by step, the same draft token kept or not
            assert 0 < sum(steps) < len(steps)  # neither nothing nor everything: the comparison can fail
            # what the manual quotes (pytest -s shows it)
            print(f"prompt {prompt!r}: genspec kept {sum(steps)} of {len(steps)}, llama-server "
                  f"{timings['draft_n_accepted']} of {timings['draft_n']}")
    assert server.process.poll() is not None  # stopped


def test_genspec_train_head_shape_eagle3_then_export_both_formats(capsys, tmp_path, tiny_model_dir_4_layers, trained):
    """The commands end to end on a tiny 4-layer model (a few steps): the default layers are llama.cpp's
    converter's clipped to distinct valid ones, the saved head drafts through ``--drafter head``, and both exports
    are written; bad input is one line, exit 2."""
    from genspec.cli import main

    out = tmp_path / "head"
    argv = ["train", "head", "--shape", "eagle3", "--model", str(tiny_model_dir_4_layers), "--out", str(out),
            "--steps", "4", "--prompts", "2", "--max-new-tokens", "8", "--vocab-size", "40"]
    assert main(argv) == 0
    assert "head written to" in capsys.readouterr().err
    head, vocab_ids, _, _ = load_head(out)
    assert isinstance(head, Eagle3Head) and head.config.feature_layers == (1, 2, 3)
    assert head.config.vocab_size == len(vocab_ids)
    base = ["generate", "--model", str(tiny_model_dir_4_layers), "--prompt", "the cat", "--max-new-tokens", "8",
            "--json", "--backend", "torch"]
    assert main(base + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--drafter", "head", "-O", f"path={out}", "-k", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]

    spec = tmp_path / "spec"
    assert main(["export", "head", str(out), "--format", "speculators", "--model", str(tiny_model_dir_4_layers),
                 "--out", str(spec)]) == 0
    assert load_speculators(spec)[1] == sorted(vocab_ids)
    target_gguf = trained[1]  # a 4-layer, 64-wide Llama GGUF with the same byte tokenizer
    assert main(["export", "head", str(out), "--format", "gguf", "--target-gguf", str(target_gguf),
                 "--out", str(tmp_path / "eagle3.gguf")]) == 0
    assert (tmp_path / "eagle3.gguf").stat().st_size > 0
    capsys.readouterr()
    # an earlier export is written over only with --force
    again = ["export", "head", str(out), "--format", "gguf", "--target-gguf", str(target_gguf),
             "--out", str(tmp_path / "eagle3.gguf")]
    assert main(again) == 2 and "pass --force" in capsys.readouterr().err
    assert main(again + ["--force"]) == 0
    again = ["export", "head", str(out), "--format", "speculators", "--model", str(tiny_model_dir_4_layers),
             "--out", str(spec)]
    assert main(again) == 2 and "--force" in capsys.readouterr().err
    assert main(again + ["--force"]) == 0
    capsys.readouterr()

    def refused(command, message):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err

    refused(argv[:6] + ["--out", str(tmp_path / "h2"), "--layers", "2"], "--shape eagle3 has one decoder layer")
    refused(argv[:6] + ["--out", str(tmp_path / "h2"), "--feature-layers", "1,2"], "exactly three --feature-layers")
    refused(["export", "head", str(out), "--format", "gguf", "--out", str(tmp_path / "x.gguf")], "needs --target-gguf")
    refused(["export", "head", str(tmp_path / "nothing"), "--format", "gguf", "--target-gguf", str(target_gguf),
             "--out", str(tmp_path / "x.gguf")], "no trained head at")
    plain_head = tmp_path / "plain"
    from genspec.speculators.store import save_head

    save_head(plain_head, DraftHead(HeadConfig(64)), list(range(3, 40)), "0")
    refused(["export", "head", str(plain_head), "--format", "speculators", "--model", str(tiny_model_dir_4_layers),
             "--out", str(tmp_path / "s2")], "not EAGLE-3 shaped")
