"""Medusa heads (``--drafter medusa``, ``genspec train medusa``) on tiny random-weight models: greedy
output equals plain decoding (chains and trees); sampled output follows the exact target law
(chi-square); training lowers the loss; a saved head of another kind is refused."""
from __future__ import annotations

import pytest
import torch
from stats_helpers import lossless_pvalue
from tiny_models import peaked, sampled_continuations, tiny_llama

from genspec.drafters.base import DraftRequest, RequestContext
from genspec.drafters.medusa import MedusaDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.sampling import SamplingConfig
from genspec.speculators.head import DraftHead, HeadConfig
from genspec.speculators.medusa import MedusaConfig, MedusaHeads
from genspec.speculators.store import load_head, save_head, target_fingerprint
from genspec.train.data import choose_vocabulary, record_features
from genspec.train.loop import train_head
from genspec.train.settings import TrainSettings


def _heads(hidden: int = 64, num_heads: int = 3, seed: int = 0, dtype=torch.float64) -> MedusaHeads:
    """Random (not zero-initialised) heads, so their drafts differ from the target's."""
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(hidden, num_heads))
    for block in heads.blocks:
        torch.nn.init.normal_(block.weight, std=0.3)
    return heads.to(dtype).eval()


@pytest.mark.parametrize("tree_nodes, batch", [(0, 1), (0, 3), (8, 1), (8, 3)])
def test_greedy_medusa_equals_plain_decoding(tiny_target, tree_nodes, batch):
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 2], [3, 4]][:batch]
    plain = SpeculativeEngine(tiny_target).generate_ids(prompts, max_new_tokens=20, eos_token_ids=())
    drafter = MedusaDrafter(tiny_target, _heads(), list(range(3, 64)), tree_nodes=tree_nodes, tree_top_k=3)
    # fixed k = 4: the drafts' depth is the drafter's (its 3 heads), not the cost policy's choice
    spec = SpeculativeEngine(tiny_target, drafter).generate_ids(prompts, max_new_tokens=20, num_draft_tokens=4,
                                                                draft_length="fixed", eos_token_ids=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.drafted_tokens for s in spec) > 0
    depth = max(len(s.stats.drafted_per_position) for s in spec)
    assert depth == 3 if not tree_nodes else 2 <= depth <= 3  # never deeper than its heads


def test_medusa_drafts_each_heads_top_token_from_the_newest_feature(tiny_target):
    """A chain is the heads' argmaxes on the feature that chose the last token; a one-branch tree is
    that chain."""
    vocab = list(range(3, 60))
    heads = _heads()
    sequence = [5, 9, 11, 3, 7, 7, 2]
    tiny_target.reset(0)
    [features] = tiny_target.add_rows([sequence[:-1]], return_hidden=True)
    tiny_target.reset(0)
    with torch.no_grad():
        logits = tiny_target.subset_head(torch.tensor(vocab))(heads(features[-1].clone()))
    expected = [vocab[int(i)] for i in logits.argmax(-1)]
    drafts = []
    for drafter in (MedusaDrafter(tiny_target, heads, vocab), MedusaDrafter(tiny_target, heads, vocab, 4, 1)):
        drafter.start([RequestContext(0, sequence, hidden=features)])
        drafts.append(drafter.propose([DraftRequest(0, sequence, 5)]).first_chain(0))
    assert drafts == [expected, expected]


@pytest.mark.parametrize("tree_nodes, seed", [(0, 31), (6, 32)])
def test_medusa_sampling_is_lossless(tree_nodes, seed):
    """Chi-square of the joint law of the first 3 generated tokens against the exact target law
    (temperature 0.7, top-k 8, top-p 0.9 on draft and target alike; N = 20,000, cells with expected
    count < 5 pooled; fail if p < 1e-3), sampled chains and deterministic trees, heads over 8 of the 12
    tokens (so rejections happen)."""
    pvalue, acceptance = lossless_pvalue(
        lambda target: MedusaDrafter(target, _heads(), list(range(8)), tree_nodes=tree_nodes, tree_top_k=3),
        SamplingConfig(temperature=0.7, top_k=8, top_p=0.9), seed=seed, layers=2)
    assert 0.02 < acceptance < 0.95
    assert pvalue > 1e-3


def test_training_medusa_lowers_the_loss_and_its_drafts_are_kept_more(tmp_path):
    target = HFCausalLM(peaked(tiny_llama(0, dtype=torch.float32), scale=4.0))
    sequences = sampled_continuations(target)
    data = record_features(target, sequences)
    vocab = choose_vocabulary(sequences, 48)
    settings = TrainSettings(steps=60, batch_size=8, sequence_length=32, learning_rate=3e-3, warmup=5,
                             checkpoint_every=30)
    log = train_head(target, data[:20], data[20:], vocab, tmp_path / "medusa", config=MedusaConfig(64, 3),
                     settings=settings, kind="medusa")
    losses = [entry["loss"] for entry in log["loss"]]
    # the loss is a cross-entropy against the target's soft law: its floor (the law's entropy, about 9
    # nats summed over 3 heads here) stays; the part the heads can learn falls (by 0.19 held out, seed 1)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.1
    before, after = log["held_out_before"], log["held_out_after"]
    assert after["loss"] < before["loss"] - 0.1 and after["agreement"] > before["agreement"]
    drafter = MedusaDrafter.for_target(target, path=str(tmp_path / "medusa"))
    held = [s[:6] for s in sequences[20:]]
    plain = SpeculativeEngine(target).generate_ids(held, max_new_tokens=20, eos_token_ids=())
    spec = SpeculativeEngine(target, drafter).generate_ids(held, max_new_tokens=20, eos_token_ids=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    # a head of the other kind in that directory is refused by name
    with pytest.raises(ConfigError, match="holds a trained medusa, not a head"):
        load_head(tmp_path / "medusa", "head")


def test_a_draft_head_directory_is_refused_by_the_medusa_drafter(tmp_path, tiny_target):
    head = DraftHead(HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128))
    save_head(tmp_path / "head", head, list(range(64)), target_fingerprint(tiny_target))
    with pytest.raises(ConfigError, match="holds a trained head, not a medusa: use --drafter head"):
        MedusaDrafter.for_target(tiny_target, path=str(tmp_path / "head"))


def test_genspec_train_medusa_then_generate_with_it(capsys, tmp_path, tiny_model_dir):
    import json

    from genspec.cli import main

    out = tmp_path / "medusa"
    argv = ["train", "medusa", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "6", "--prompts", "4",
            "--max-new-tokens", "16", "--vocab-size", "64", "--num-heads", "3"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "medusa written to" in err and "held-out acceptance" in err
    assert load_head(out, "medusa")[0].config.num_heads == 3
    assert (out / "training_curve.png").stat().st_size > 1000 and (out / "sequences.json").is_file()
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "the cat sat", "--max-new-tokens", "12", "--json"]
    assert main(base + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--drafter", "medusa", "-O", f"path={out}", "-O", "tree_nodes=6", "-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert main(["train", "medusa", "--model", str(tiny_model_dir), "--out", str(tmp_path / "m2"),
                 "--num-heads", "0"]) == 2
    assert "--num-heads must be from 1 to 64" in capsys.readouterr().err
