"""The pruned self-draft (``--drafter pruned``, ``genspec calibrate prune``): the pruned copy has the sizes its
plan promises, shares what it keeps whole, computes the target with the pruned units removed (keep 1: the
target itself), drafts losslessly (greedy equality at batch 1 and 4, chi-square of sampled outputs), and bad
options are refused with one line."""
from __future__ import annotations

import json
import math

import pytest
import torch
from stats_helpers import lossless_pvalue
from test_drafters_self import PROMPTS, SAMPLING
from tiny_models import tiny_gemma3, tiny_llama

import genspec
from genspec.bench.methods import parse_method
from genspec.calibration import check_keep, choose_units, head_counts, score_units
from genspec.cli import main
from genspec.drafters import DraftModelDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError, InputFileError
from genspec.models import HFCausalLM, variants
from genspec.speculators.store import target_fingerprint


def _sequences(vocab: int, count: int = 3, length: int = 24) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def make_plan(target: HFCausalLM, keep: float = 0.5, keep_layers: float = 1.0) -> dict:
    """What ``genspec calibrate prune`` chooses, scored on random token sequences."""
    heads, channels, influence, tokens = score_units(target, _sequences(target.vocab_size))
    assert tokens == 3 * 24
    shapes = [variants.attention_shape(layer) for layer in target.decoder.layers]
    return choose_units(heads, channels, influence, shapes, keep, keep_layers)


def pruned_copy(target: HFCausalLM, keep: float = 0.5, keep_layers: float = 1.0) -> HFCausalLM:
    plan = make_plan(target, keep, keep_layers)
    return variants.pruned(target, plan["layers"], plan["heads"], plan["channels"])


def write_plan(path, target: HFCausalLM, plan: dict, fingerprint: str | None = None):
    path.write_text(json.dumps({**plan, "fingerprint": fingerprint or target_fingerprint(target)}))
    return str(path)


# ------------------------------------------------------------------------------ the pruned copy
@pytest.mark.parametrize("build, kv_heads, kv_kept", [
    (lambda: tiny_llama(0, layers=3), 2, 2),              # grouped-query: one query head per key/value head
    (lambda: tiny_llama(0, layers=3, kv_heads=4), 4, 2),  # multi-head: two whole heads with their keys/values
    (lambda: tiny_gemma3(0, layers=3), 1, 1),             # one key/value head serving two query heads
])
def test_the_pruned_copy_has_the_promised_sizes_and_shares_the_rest(build, kv_heads, kv_kept):
    target = HFCausalLM(build())
    draft = pruned_copy(target, keep=0.5)
    assert draft.num_layers == 3 and target.num_layers == 3
    for mine, theirs in zip(draft.decoder.layers, target.decoder.layers):
        attention, size = mine.self_attn, theirs.self_attn.head_dim
        assert attention.q_proj.out_features == 2 * size and attention.o_proj.in_features == 2 * size
        assert attention.k_proj.out_features == kv_kept * size and attention.v_proj.out_features == kv_kept * size
        assert attention.num_key_value_groups == 2 // kv_kept
        assert (attention.k_proj is theirs.self_attn.k_proj) == (kv_kept == kv_heads)  # kept whole: shared
        assert mine.mlp.gate_proj.out_features == mine.mlp.up_proj.out_features == mine.mlp.down_proj.in_features == 64
        assert mine.input_layernorm is theirs.input_layernorm
        assert mine.post_attention_layernorm is theirs.post_attention_layernorm
        assert theirs.self_attn.q_proj.out_features == 4 * size and theirs.mlp.down_proj.in_features == 128  # untouched
    assert draft.decoder.embed_tokens is target.decoder.embed_tokens and draft.decoder.norm is target.decoder.norm
    assert draft.lm_head is target.lm_head and draft.model is target.model


def test_the_decoder_weights_kept():
    """Tiny Llama (hidden 64, 4 heads of 16, 2 key/value heads, MLP 128), half of the heads and channels: per
    layer q 64x32 + k, v 64x32 each + o 32x64 + gate, up, down 64x64 each + 2 norms of 64 = 20,608 of
    36,992; three quarters of 4 layers (the first and last always kept) keep 3."""
    target = HFCausalLM(tiny_llama(0, layers=4))
    assert variants.decoder_parameters(target) == 4 * 36_992
    draft = pruned_copy(target, keep=0.5, keep_layers=0.75)
    assert draft.num_layers == 3 and variants.decoder_parameters(draft) == 3 * 20_608
    assert draft.decoder.layers[0].input_layernorm is target.decoder.layers[0].input_layernorm
    assert draft.decoder.layers[-1].input_layernorm is target.decoder.layers[3].input_layernorm


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_keep_one_gives_the_targets_logits(build):
    target = HFCausalLM(build(0, layers=3))
    draft = pruned_copy(target, keep=1.0)
    assert all(a is b for a, b in zip(draft.decoder.layers, target.decoder.layers))
    tokens = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    valid = tokens > 0
    for model in (target, draft):
        model.reset(2)
    assert torch.equal(draft.forward(tokens, valid), target.forward(tokens, valid))


def _zeroed(model, plan: dict):
    """``model`` with the output columns of every unit the plan removes set to zero (a removed head adds
    nothing to the residual stream, nor does a removed channel), in place."""
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            size = layer.self_attn.head_dim
            for head in set(range(layer.self_attn.o_proj.in_features // size)) - set(plan["heads"][i]):
                layer.self_attn.o_proj.weight[:, head * size:(head + 1) * size] = 0
            gone = sorted(set(range(layer.mlp.down_proj.in_features)) - set(plan["channels"][i]))
            layer.mlp.down_proj.weight[:, gone] = 0
    return model


@pytest.mark.parametrize("build, kv_heads, tolerance", [
    (tiny_llama, 2, 1e-10), (tiny_llama, 4, 1e-10), (tiny_gemma3, 1, 1e-5)])
def test_the_pruned_copy_is_the_target_without_the_pruned_units(build, kv_heads, tolerance):
    """The pruned copy's logits are those of the target whose removed heads, channels and layers add nothing
    (their output weights zeroed, the layers skipped): the heads kept are the right ones, in their groups.
    float64 (Gemma 3's norms run in float32, hence its looser tolerance)."""
    options = {"kv_heads": kv_heads} if build is tiny_llama else {}
    target = HFCausalLM(build(0, layers=3, **options))
    plan = make_plan(target, keep=0.5, keep_layers=0.67)
    assert plan["layers"] == [0, 2]
    draft = variants.pruned(target, plan["layers"], plan["heads"], plan["channels"])
    reference = variants.layer_skip(HFCausalLM(_zeroed(build(0, layers=3, **options), plan)), [1])
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 0, 0, 0]])
    valid = tokens > 0
    for model in (draft, reference):
        model.reset(2)
    assert torch.allclose(draft.forward(tokens, valid)[valid], reference.forward(tokens, valid)[valid], atol=tolerance)


def test_scores_find_the_units_that_do_nothing():
    """A head whose output weights are zero, a channel whose down-projection column is zero and a layer
    that adds nothing to the residual stream score 0 and are the first to go."""
    model = tiny_llama(0, layers=4)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[:, 16:32] = 0  # head 1 of layer 1
        model.model.layers[1].mlp.down_proj.weight[:, 5] = 0  # channel 5 of layer 1
        model.model.layers[2].self_attn.o_proj.weight.zero_()  # layer 2: the identity
        model.model.layers[2].mlp.down_proj.weight.zero_()
    target = HFCausalLM(model)
    heads, channels, influence, _ = score_units(target, _sequences(64))
    assert heads[1][1] == 0 and heads[1][0] > 0 and channels[1][5] == 0 and bool((channels[1][6:] > 0).all())
    assert influence[2] < 1e-12 and bool((influence[[0, 1, 3]] > 1e-6).all())
    shapes = [variants.attention_shape(layer) for layer in target.decoder.layers]
    plan = choose_units(heads, channels, influence, shapes, keep=0.75, keep_layers=0.75)
    assert plan["layers"] == [0, 1, 3]
    assert 1 not in plan["heads"][1] and 0 in plan["heads"][1]
    assert 5 not in plan["channels"][1] and len(plan["channels"][1]) == 96
    assert target.num_rows == 0  # the scoring left no row behind


@pytest.mark.parametrize("heads, kv, keep, expected", [
    (4, 2, 0.5, (2, 1)), (4, 4, 0.5, (2, 1)), (4, 1, 0.5, (1, 2)), (4, 1, 0.25, (1, 1)), (4, 2, 1.0, (2, 2)),
    (8, 2, 0.5, (2, 2)), (32, 8, 0.3, (5, 2)), (4, 2, 0.01, (1, 1))])
def test_head_counts(heads, kv, keep, expected):
    assert head_counts(heads, kv, keep) == expected


# ------------------------------------------------------------------------------ lossless drafting
@pytest.mark.parametrize("build, keep, keep_layers", [(tiny_llama, 0.5, 1.0), (tiny_gemma3, 0.25, 0.67)])
def test_greedy_equality(build, keep, keep_layers):
    target = HFCausalLM(build(0, layers=3, dtype=torch.float32))
    plain = SpeculativeEngine(target).generate_ids(PROMPTS, max_new_tokens=20, eos_token_ids=())
    single = SpeculativeEngine(target, DraftModelDrafter(pruned_copy(target, keep, keep_layers))).generate_ids(
        PROMPTS[:1], max_new_tokens=20, eos_token_ids=(), num_draft_tokens=4, draft_length="fixed")
    batch = SpeculativeEngine(target, DraftModelDrafter(pruned_copy(target, keep, keep_layers))).generate_ids(
        PROMPTS, max_new_tokens=20, eos_token_ids=(), num_draft_tokens=4, draft_length="fixed")
    assert single[0].token_ids == plain[0].token_ids
    assert [r.token_ids for r in batch] == [p.token_ids for p in plain]
    assert sum(r.stats.drafted_tokens for r in batch) > 0


@pytest.mark.slow
def test_lossless_sampling():
    """Chi-square of the first 3 tokens' joint law vs the exact target law (T=0.7, top-k 8, top-p 0.9) with
    half the heads and MLP channels pruned, N = 20,000, cells with expected count < 5 pooled, fail if
    p < 1e-3; the draft must differ from the target (acceptance < 0.98). About 80 s on 2 shared cores."""
    pvalue, acceptance = lossless_pvalue(lambda t: DraftModelDrafter(pruned_copy(t, 0.5)), SAMPLING, seed=28)
    assert acceptance < 0.98
    assert pvalue > 1e-3


def test_lossless_sampling_smoke():
    """The same chi-square test at N = 4,000 (cells with expected count < 5 pooled, fail if p < 1e-3), the
    default run's bounded version of the slow one (whose N sees smaller departures from the exact law)."""
    pvalue, acceptance = lossless_pvalue(lambda t: DraftModelDrafter(pruned_copy(t, 0.5)), SAMPLING,
                                         num_samples=4_000, seed=29)
    assert acceptance < 0.98
    assert pvalue > 1e-3


# ------------------------------------------------------------------------------ options and plans
@pytest.mark.parametrize("value", [0, -0.5, 1.5, math.nan, math.inf, True, "half"])
def test_bad_keep_is_refused(value):
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        check_keep(value, "keep")


def test_plans_are_checked(tmp_path):
    target = HFCausalLM(tiny_llama(0, layers=3))
    plan = make_plan(target)
    with pytest.raises(ConfigError, match="needs a pruning plan"):
        genspec.build_drafter("pruned", target)
    with pytest.raises(InputFileError, match="not found"):
        genspec.build_drafter("pruned", target, path=str(tmp_path / "missing.json"))
    other = HFCausalLM(tiny_llama(1, layers=3))  # same shapes, other weights
    with pytest.raises(ConfigError, match="made for another model"):
        genspec.build_drafter("pruned", other, path=write_plan(tmp_path / "plan.json", target, plan))
    bad = {**plan, "heads": [[0, 1, 2], *plan["heads"][1:]]}  # 2 heads of one group, 1 of the other
    with pytest.raises(InputFileError, match="as many query heads"):
        genspec.build_drafter("pruned", target, path=write_plan(tmp_path / "bad.json", target, bad))
    bad = {**plan, "channels": plan["channels"][:2]}
    with pytest.raises(InputFileError, match="each of the target's 3 layers"):
        genspec.build_drafter("pruned", target, path=write_plan(tmp_path / "bad.json", target, bad))
    bad = {**plan, "layers": [2, 0]}
    with pytest.raises(InputFileError, match="distinct sorted indices"):
        genspec.build_drafter("pruned", target, path=write_plan(tmp_path / "bad.json", target, bad))
    (tmp_path / "skip.json").write_text(json.dumps({"skip": [1]}))  # another calibration's file
    with pytest.raises(InputFileError, match='"layers"'):
        genspec.build_drafter("pruned", target, path=str(tmp_path / "skip.json"))
    drafter = genspec.build_drafter("pruned", target, path=write_plan(tmp_path / "plan.json", target, plan),
                                    draft_vocab_file=None, num_drafts=2)
    assert drafter.model.decoder.layers[0].self_attn.q_proj.out_features == 32
    with pytest.raises(ConfigError, match="needs a pruning plan"):
        parse_method("pruned")
    assert parse_method("pruned:path=plan.json").options == {"path": "plan.json"}


@pytest.mark.parametrize("extra, message", [
    (["--drafter", "pruned"], "needs a pruning plan"),
    (["--drafter", "pruned", "-O", "path=/no/plan.json"], "calibration file not found: /no/plan.json"),
])
def test_generate_refuses_in_one_line(capsys, tiny_model_dir, extra, message):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-new-tokens", "2"] + extra) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("extra, message", [
    (["--keep", "0"], "--keep must be in (0, 1], got 0.0"),
    (["--keep", "1.5"], "--keep must be in (0, 1], got 1.5"),
    (["--keep", "nan"], "--keep must be in (0, 1], got nan"),
    (["--keep-layers", "0"], "--keep-layers must be in (0, 1]"),
    (["--prompts", "0"], "--prompts must be >= 1"),
])
def test_calibrate_prune_refuses_in_one_line(capsys, tmp_path, extra, message):
    argv = ["calibrate", "prune", "--model", "/no/such/model", "--out", str(tmp_path / "plan.json")] + extra
    assert main(argv) == 2  # refused before the (missing) model is looked for
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


# ------------------------------------------------------------------------------ healing
def test_healing_lowers_the_held_out_kl_and_resumes_exactly(tmp_path):
    """A few distillation steps of the pruned copy's own weights bring its laws closer to the target's on
    held-out sequences; a run stopped at its checkpoint and resumed ends with the weights of a run never
    stopped; the target's weights and their flags are untouched; the healed weights round-trip through the
    drafter's plan."""
    from tiny_models import peaked, sampled_continuations

    from genspec.train.heal import heal, read_checkpoint

    target = HFCausalLM(peaked(tiny_llama(0, layers=3), 4.0))  # laws far from uniform: KL to gain back
    before = {name: p.detach().clone() for name, p in target.model.named_parameters()}
    flags = {name: p.requires_grad for name, p in target.model.named_parameters()}
    sequences = sampled_continuations(target, count=10, length=20)
    train, held = sequences[:8], sequences[8:]
    plan = make_plan(target, keep=0.5)

    def fresh():
        return variants.pruned(target, plan["layers"], plan["heads"], plan["channels"])

    whole = fresh()
    log = heal(target, whole, train, held, steps=6, learning_rate=1e-3, piece_tokens=16)
    assert log["held_out_kl_after"] < log["held_out_kl_before"] and len(log["losses"]) == 6
    stopped, checkpoint = fresh(), tmp_path / "plan.checkpoint.pt"
    heal(target, stopped, train, held, steps=3, learning_rate=1e-3, piece_tokens=16, checkpoint=checkpoint,
         saved_with={"plan": plan}, checkpoint_every=2)
    state = read_checkpoint(checkpoint)
    assert state["step"] == 3 and state["plan"]["layers"] == plan["layers"]
    resumed = fresh()
    assert heal(target, resumed, train, held, steps=6, learning_rate=1e-3, piece_tokens=16,
                resume=state)["losses"] == log["losses"]
    mine, theirs = variants.own_weights(resumed, target), variants.own_weights(whole, target)
    assert set(mine) == set(theirs) and all(torch.allclose(mine[n], theirs[n], atol=1e-12) for n in mine)
    assert all(torch.equal(p, before[name]) for name, p in target.model.named_parameters())
    assert {name: p.requires_grad for name, p in target.model.named_parameters()} == flags

    variants.save_own_weights(tmp_path / "plan.safetensors", whole, target)
    path = write_plan(tmp_path / "plan.json", target, {**plan, "healed": {"weights": "plan.safetensors"}})
    drafter = genspec.build_drafter("pruned", target, path=path)
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    for model in (drafter.model, whole):
        model.reset(1)
    assert torch.equal(drafter.model.forward(tokens), whole.forward(tokens))
    variants.save_own_weights(tmp_path / "plan.safetensors", fresh(), HFCausalLM(tiny_llama(1, layers=3)))
    with pytest.raises(InputFileError, match="another pruned copy"):  # every weight is its own there
        genspec.build_drafter("pruned", target, path=path)
    (tmp_path / "plan.safetensors").unlink()
    with pytest.raises(InputFileError, match="healed weights not found"):
        genspec.build_drafter("pruned", target, path=path)


def test_calibrate_prune_writes_the_plan_the_drafter_reads(tmp_path, tiny_model_dir_4_layers, capsys):
    """On a tiny saved model (4 layers, 4 heads of 16 over 2 key/value heads, MLP 128): the plan keeps 3
    layers, 2 heads and 64 channels in each, and names its healed weights (``--heal-steps``), written beside
    it; ``--resume`` continues the healing from its checkpoint; a checkpoint in the way and a resume without
    one are refused in one line; ``--drafter pruned`` reads the plan from the library, a server's
    per-request choice and the CLI, and greedy output equals plain decoding."""
    out = tmp_path / "plan.json"
    base = ["calibrate", "prune", "--model", str(tiny_model_dir_4_layers), "--out", str(out), "--keep", "0.5",
            "--keep-layers", "0.75", "--prompts", "1", "--continuation", "4", "--tokens", "4", "--heal-tokens", "32"]
    assert main(base + ["--resume", "--heal-steps", "2"]) == 2
    assert "no healing checkpoint" in capsys.readouterr().err
    assert main(base + ["--heal-steps", "2"]) == 0
    assert "written to" in capsys.readouterr().err
    first = json.loads(out.read_text())
    assert len(first["layers"]) == 3 and first["layers"][0] == 0 and first["layers"][-1] == 3
    assert all(len(first["heads"][i]) == 2 and len(first["channels"][i]) == 64 for i in range(4))
    assert first["parameters"]["pruned"] == 3 * 20_608 and first["parameters"]["target"] == 4 * 36_992
    assert 0.0 <= first["alpha"] <= 1.0 and first["predicted_speedup"] > 0 and first["draft_step_s"] > 0
    calibration = first["calibration"]
    assert calibration["continued_prompts"] + calibration["teacher_forced_sequences"] == 13
    assert first["scored_sequences"] == 13 - calibration["held_out_sequences"] and len(first["scores"]["heads"]) == 4
    assert first["healed"]["weights"] == "plan.safetensors" and len(first["healed"]["losses"]) == 2
    assert (tmp_path / "plan.safetensors").is_file() and (tmp_path / "plan.checkpoint.pt").is_file()

    assert main(base + ["--heal-steps", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pass --resume" in err and len(err.splitlines()) == 1
    assert main(base + ["--heal-steps", "3", "--resume"]) == 0
    second = json.loads(out.read_text())
    assert second["healed"]["losses"][:2] == first["healed"]["losses"] and len(second["healed"]["losses"]) == 3
    assert all(second[key] == first[key] for key in ("layers", "heads", "channels"))

    plain = genspec.load(str(tiny_model_dir_4_layers), drafter="none").generate("Hello there", max_new_tokens=12,
                                                                                 temperature=0.0)[0]
    engine = genspec.load(str(tiny_model_dir_4_layers), drafter="pruned", path=str(out))
    assert engine.drafter.model.num_layers == 3
    assert engine.generate("Hello there", max_new_tokens=12, temperature=0.0)[0].token_ids == plain.token_ids

    from fastapi.testclient import TestClient

    from genspec.serve.app import create_app
    from genspec.serve.settings import ServerSettings

    served = genspec.load(str(tiny_model_dir_4_layers), drafter="none", extra_drafters={"pruned": {"path": str(out)}})
    with TestClient(create_app(served, ServerSettings(served_model_name="tiny"))) as client:
        response = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 12, "temperature": 0,
                                                        "speculative": {"drafter": "pruned"}})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == plain.text

    capsys.readouterr()
    assert main(["generate", "--model", str(tiny_model_dir_4_layers), "--prompt", "Hello there", "--max-new-tokens",
                 "12", "--drafter", "pruned", "-O", f"path={out}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"][0]["token_ids"] == plain.token_ids
