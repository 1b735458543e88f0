"""The distilled draft model (``--drafter draft``, ``genspec train draft``) on tiny random-weight
models: at the engine's interface it is a model over the target's whole vocabulary (ids mapped in,
logits mapped out); greedy output equals plain decoding (chains and multi-draft trees); sampled output
follows the exact target law (chi-square); training lowers the loss; ``--draft-model DIR`` loads it."""
from __future__ import annotations

import pytest
import torch
from stats_helpers import lossless_pvalue
from tiny_models import peaked, sampled_continuations, tiny_llama

from genspec.drafters.distilled import DistilledDrafter
from genspec.engine import SpeculativeEngine
from genspec.models import HFCausalLM
from genspec.sampling import SamplingConfig
from genspec.speculators.distilled import DistilledDraft, DistilledLM, DraftConfig
from genspec.train.data import choose_vocabulary, record_features
from genspec.train.loop import train_head
from genspec.train.settings import TrainSettings


def _draft(vocab_ids: list[int], hidden: int = 64, seed: int = 0) -> DistilledDraft:
    torch.manual_seed(seed)
    config = DraftConfig(hidden, len(vocab_ids) + 1, width=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=64, max_positions=256)
    return DistilledDraft(config).to(torch.float64).eval()


def test_the_draft_maps_ids_in_and_logits_out():
    vocab = [7, 3, 50, 11]
    draft = _draft(vocab)
    model = DistilledLM(draft, vocab, 64)
    assert model.vocab_size == 64
    model.reset(1)
    logits = model.forward(torch.tensor([[3, 50, 60]]))  # 60: outside the vocabulary ("other")
    local = draft(torch.tensor([[1, 2, 4]]))
    assert logits.shape == (1, 3, 64)
    assert torch.isinf(logits[..., [i for i in range(64) if i not in vocab]]).all()
    torch.testing.assert_close(logits[..., vocab], local)


@pytest.mark.parametrize("num_drafts, batch", [(1, 1), (1, 3), (2, 3)])
def test_greedy_distilled_drafting_equals_plain_decoding(tiny_target, num_drafts, batch):
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 2], [3, 4]][:batch]
    plain = SpeculativeEngine(tiny_target).generate_ids(prompts, max_new_tokens=20, eos_token_ids=())
    vocab = choose_vocabulary([p.token_ids for p in plain], 40)
    drafter = DistilledDrafter(DistilledLM(_draft(vocab), vocab, 64), num_drafts=num_drafts)
    spec = SpeculativeEngine(tiny_target, drafter).generate_ids(prompts, max_new_tokens=20, num_draft_tokens=3,
                                                                eos_token_ids=(), draft_length="fixed")
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.drafted_tokens for s in spec) > 0


def test_distilled_sampling_is_lossless():
    """Chi-square of the joint law of the first 3 generated tokens against the exact target law
    (temperature 0.7, top-k 8, top-p 0.9 on draft and target alike; N = 20,000, cells with expected
    count < 5 pooled; fail if p < 1e-3), a draft over 8 of the 12 tokens."""
    vocab = list(range(8))
    pvalue, acceptance = lossless_pvalue(lambda target: DistilledDrafter(DistilledLM(_draft(vocab), vocab, 12)),
                                         SamplingConfig(temperature=0.7, top_k=8, top_p=0.9), seed=41, layers=2)
    assert 0.02 < acceptance < 0.95
    assert pvalue > 1e-3


def test_training_the_draft_lowers_the_loss_and_raises_acceptance(tmp_path):
    target = HFCausalLM(peaked(tiny_llama(0, dtype=torch.float32), scale=4.0))
    sequences = sampled_continuations(target)
    data = record_features(target, sequences)
    vocab = choose_vocabulary(sequences, 48)
    config = DraftConfig(64, len(vocab) + 1, width=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=64, max_positions=256)
    settings = TrainSettings(steps=60, batch_size=8, sequence_length=32, learning_rate=3e-3, warmup=5,
                             checkpoint_every=30)
    log = train_head(target, data[:20], data[20:], vocab, tmp_path / "draft", config=config, settings=settings,
                     kind="draft")
    losses = [entry["loss"] for entry in log["loss"]]
    # a cross-entropy against the target's soft law: it starts near log 48 = 3.87 (uniform) and its
    # floor is the law's entropy; 60 steps take it down by 0.11 (seed 1)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.05
    before, after = log["held_out_before"], log["held_out_after"]
    assert after["loss"] < before["loss"] and after["agreement"] > before["agreement"]
    held = [s[:6] for s in sequences[20:]]
    plain = SpeculativeEngine(target).generate_ids(held, max_new_tokens=20, eos_token_ids=())
    for drafter in (DistilledDrafter.for_target(target, path=str(tmp_path / "draft")),
                    __import__("genspec").build_drafter("draft-model", target, draft_model=str(tmp_path / "draft"))):
        # fixed draft lengths: the cost policy reads the clock, and on a loaded machine it may stop drafting
        spec = SpeculativeEngine(target, drafter).generate_ids(held, max_new_tokens=20, num_draft_tokens=3,
                                                               draft_length="fixed", eos_token_ids=())
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
        assert sum(s.stats.accepted_tokens for s in spec) > 0


def test_genspec_train_draft_then_generate_with_it(capsys, tmp_path, tiny_model_dir):
    import json

    from genspec.cli import main

    out = tmp_path / "draft"
    argv = ["train", "draft", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "6", "--prompts", "4",
            "--max-new-tokens", "16", "--vocab-size", "64", "--width", "32", "--layers", "1"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "draft written to" in err and "held-out acceptance" in err
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "the cat sat", "--max-new-tokens", "12", "--json"]
    assert main(base + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--drafter", "draft", "-O", f"path={out}", "-k", "3", "--draft-length", "fixed"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert spec["stats"]["drafted_tokens"] > 0
