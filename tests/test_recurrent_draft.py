"""The recurrent distilled draft (``genspec train draft --arch gru|lstm``, drafting with ``--drafter draft``) on tiny
random-weight models. Its per-row cache is its state after each token: a block is read from each row's last state,
a rollback picks the state at the last kept position, a tree reads each node from its parent's state. Greedy
output equals plain decoding (batch 1 and 4, one chain or several); sampled output follows the exact target law
(chi-square); drafting after a rejection equals drafting fresh; a few training steps lower the loss and an
interrupted run resumes to the weights of an uninterrupted one; the command line trains one, generates with it and
refuses bad options in one line; a server request picks it by name."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from stats_helpers import lossless_pvalue
from tiny_models import peaked, sampled_continuations, tiny_llama

import genspec
from genspec.drafters.base import DraftRequest
from genspec.drafters.distilled import DistilledDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.sampling import SamplingConfig
from genspec.speculators.distilled import DraftConfig
from genspec.speculators.recurrent import RecurrentDraft, RecurrentLM
from genspec.speculators.store import load_head, save_head, target_fingerprint
from genspec.train.data import choose_vocabulary, record_features
from genspec.train.loop import CHECKPOINT, load_checkpoint, resumable_state, train_head
from genspec.train.settings import TrainSettings

#: the draft vocabulary of the model-level tests (of the tiny target's 64 tokens; the rest map to "other")
VOCAB = list(range(3, 40))
ARCHS = ("gru", "lstm")


def _draft(vocab_ids: list[int], arch: str = "gru", seed: int = 0, layers: int = 2,
           dtype=torch.float64) -> RecurrentDraft:
    torch.manual_seed(seed)
    return RecurrentDraft(DraftConfig(64, len(vocab_ids) + 1, width=32, num_layers=layers, arch=arch)).to(dtype).eval()


def _filled(model: RecurrentLM, prefixes: list[list[int]]) -> RecurrentLM:
    model.reset(0)
    model.add_rows(prefixes)
    return model


# ------------------------------------------------------------------------------ the model and its state
@pytest.mark.parametrize("arch", ARCHS)
def test_the_model_drafts_with_the_network_training_trains(arch):
    """Block after block, the adapter's logits are those of the network over the whole sequence (what training
    reads, with the layers' fused kernels), mapped to the full vocabulary (-inf outside the draft's)."""
    draft = _draft(VOCAB, arch)
    model = _filled(draft.as_model(VOCAB, 64), [[3, 50]])  # 50: outside the vocabulary ("other")
    assert model.vocab_size == 64 and model.lengths.tolist() == [2]
    logits = model.forward(torch.tensor([[7, 60, 12]]))
    model.commit_all()
    later = model.forward(torch.tensor([[9]]))
    with torch.no_grad():
        whole = draft(torch.tensor([[0, len(VOCAB), 4, len(VOCAB), 9, 6]]))
    torch.testing.assert_close(logits[..., VOCAB], whole[:, 2:5])
    torch.testing.assert_close(later[..., VOCAB], whole[:, 5:])
    assert torch.isinf(logits[..., [i for i in range(64) if i not in VOCAB]]).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_rollback_picks_the_state_at_the_last_kept_position(arch):
    """Two rows of different lengths draft 4 tokens; row 0 keeps 2, row 1 keeps 1 (a rejection): the next block's
    logits are those of a model that read the kept sequences whole; then a truncation back into the prompts."""
    draft = _draft(VOCAB, arch)
    model = _filled(draft.as_model(VOCAB, 64), [[5, 9, 11], [5, 9, 11, 3, 7]])
    model.forward(torch.tensor([[20, 21, 22, 23], [30, 31, 32, 33]]))
    model.keep_block(torch.tensor([[0, 1, -1, -1], [0, -1, -1, -1]]))
    assert model.lengths.tolist() == [5, 6]
    after = model.forward(torch.tensor([[24, 25], [26, 27]]))
    fresh = _filled(draft.as_model(VOCAB, 64), [[5, 9, 11, 20, 21], [5, 9, 11, 3, 7, 30]])
    torch.testing.assert_close(after, fresh.forward(torch.tensor([[24, 25], [26, 27]])))
    model.commit_all()
    model.truncate(torch.tensor([2, 4]))
    assert model.lengths.tolist() == [2, 4]
    tokens, valid = torch.tensor([[8, 8], [6, 0]]), torch.tensor([[True, True], [True, False]])
    short = _filled(draft.as_model(VOCAB, 64), [[5, 9], [5, 9, 11, 3]])
    torch.testing.assert_close(model.forward(tokens, valid)[valid], short.forward(tokens, valid)[valid])


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tree_block_reads_each_node_from_its_parent(arch):
    """A tree a -> (b -> d, c): each node's logits are those of its root-to-node chain; keeping the path a, c
    leaves the row's state after a, c."""
    draft = _draft(VOCAB, arch)
    prompt = [5, 9, 11]
    model = _filled(draft.as_model(VOCAB, 64), [prompt])
    tokens = torch.tensor([[20, 21, 22, 23]])
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    logits = model.forward(tokens, tree_mask=tree)
    for path in ([0, 1, 3], [0, 2]):
        chain = _filled(draft.as_model(VOCAB, 64), [prompt]).forward(tokens[:, path])
        torch.testing.assert_close(logits[:, path], chain)
    model.keep_block(torch.tensor([[0, 2]]))
    expected = _filled(draft.as_model(VOCAB, 64), [prompt + [20, 22]]).forward(torch.tensor([[30]]))
    torch.testing.assert_close(model.forward(torch.tensor([[30]])), expected)


def test_what_the_recurrent_model_cannot_do_is_a_clear_error():
    model = _filled(_draft(VOCAB).as_model(VOCAB, 64), [[5, 9]])
    with pytest.raises(ConfigError, match="no decoder layers"):
        model.forward(torch.tensor([[3]]), hidden_layers=(1,))
    with pytest.raises(ConfigError, match="arch is one of"):
        DraftConfig(64, 10, arch="rnn")


# ------------------------------------------------------------------------------ drafting
@pytest.mark.parametrize("arch", ARCHS)
def test_drafting_after_a_rejection_equals_drafting_fresh(arch):
    """Two requests draft 4 tokens; the target keeps request 0's first token and replaces its second, and keeps
    all of request 1's with a bonus token. The next drafts (greedy) equal a new drafter's from the same committed
    sequences, and so do the draft model's laws there."""
    draft = _draft(VOCAB, arch, layers=1)
    drafter = DistilledDrafter(draft.as_model(VOCAB, 64))
    sequences = [[5, 9, 11, 3], [7, 7, 8]]
    first = drafter.propose([DraftRequest(i, s, 4) for i, s in enumerate(sequences)])
    chains = [first.first_chain(0), first.first_chain(1)]
    assert [len(c) for c in chains] == [4, 4]
    replaced = next(t for t in VOCAB if t != chains[0][1])
    committed = [sequences[0] + chains[0][:1] + [replaced], sequences[1] + chains[1] + [12]]
    again = drafter.propose([DraftRequest(i, s, 4) for i, s in enumerate(committed)])
    fresh_drafter = DistilledDrafter(draft.as_model(VOCAB, 64))
    fresh = fresh_drafter.propose([DraftRequest(i, s, 4) for i, s in enumerate(committed)])
    assert [again.first_chain(r) for r in range(2)] == [fresh.first_chain(r) for r in range(2)]
    # the laws behind them: each model's next-token logits after the committed sequences (it holds the drafts now)
    for model in (drafter.model, fresh_drafter.model):
        model.truncate(torch.tensor([len(s) - 1 for s in committed]))
    last = torch.tensor([[s[-1]] for s in committed])
    torch.testing.assert_close(drafter.model.forward(last), fresh_drafter.model.forward(last))


@pytest.mark.parametrize("arch, num_drafts, batch", [("gru", 1, 1), ("gru", 1, 4), ("lstm", 1, 1), ("lstm", 3, 4)])
def test_greedy_recurrent_drafting_equals_plain_decoding(tiny_target, arch, num_drafts, batch):
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 2], [3, 4], [10, 11, 12, 13, 14, 15]][:batch]
    plain = SpeculativeEngine(tiny_target).generate_ids(prompts, max_new_tokens=20, eos_token_ids=())
    vocab = choose_vocabulary([p.token_ids for p in plain], 40)
    drafter = DistilledDrafter(RecurrentLM(_draft(vocab, arch), vocab, 64), num_drafts=num_drafts)
    spec = SpeculativeEngine(tiny_target, drafter).generate_ids(prompts, max_new_tokens=20, num_draft_tokens=3,
                                                                eos_token_ids=(), draft_length="fixed")
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.drafted_tokens for s in spec) > 0


def _lossless(arch: str, num_drafts: int, num_samples: int, length: int):
    vocab = list(range(8))
    return lossless_pvalue(
        lambda target: DistilledDrafter(RecurrentLM(_draft(vocab, arch), vocab, 12), num_drafts=num_drafts),
        SamplingConfig(temperature=0.7, top_k=8, top_p=0.9), num_samples=num_samples, length=length, seed=43,
        layers=2)


def test_recurrent_sampling_is_lossless_smoke():
    """The default run's bounded version of the test below: two sampled GRU chains per step (verified as a tree),
    the joint law of the first 2 generated tokens, N = 4,000; fail if p < 1e-3."""
    pvalue, acceptance = _lossless("gru", 2, 4000, 2)
    assert 0.02 < acceptance < 0.95
    assert pvalue > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("arch, num_drafts", [("gru", 1), ("gru", 2), ("lstm", 1), ("lstm", 2)])
def test_recurrent_sampling_is_lossless(arch, num_drafts):
    """Chi-square of the joint law of the first 3 generated tokens against the exact target law (temperature
    0.7, top-k 8, top-p 0.9 on draft and target alike; N = 20,000, cells with expected count < 5 pooled; fail
    if p < 1e-3), a recurrent draft over 8 of the 12 tokens: one sampled chain, or two verified as a tree."""
    pvalue, acceptance = _lossless(arch, num_drafts, 20_000, 3)
    assert 0.02 < acceptance < 0.95
    assert pvalue > 1e-3


# ------------------------------------------------------------------------------ training
def test_training_a_recurrent_draft_lowers_the_loss_and_an_interrupted_run_resumes(tmp_path):
    """40 steps of a 1-layer GRU draft on the tiny target's own continuations lower the loss and raise held-out
    agreement; the saved directory loads as the recurrent network and drafts (greedy = plain, some drafts kept).
    A run stopped at step 25 (its checkpoint: step 20) and resumed ends with the uninterrupted run's weights; a
    checkpoint of another arch is refused."""
    target = HFCausalLM(peaked(tiny_llama(0, dtype=torch.float32), scale=4.0))
    sequences = sampled_continuations(target)
    data = record_features(target, sequences)
    vocab = choose_vocabulary(sequences, 48)
    config = DraftConfig(64, len(vocab) + 1, width=32, num_layers=1, arch="gru")
    settings = TrainSettings(steps=40, batch_size=8, sequence_length=32, learning_rate=1e-2, warmup=5,
                             checkpoint_every=10, held_out_every=0)

    def train(out, **kwargs):
        return train_head(target, data[:20], data[20:], vocab, tmp_path / out, config=kwargs.pop("config", config),
                          settings=settings, kind="draft", **kwargs)

    log = train("whole")
    losses = [entry["loss"] for entry in log["loss"]]
    # a cross-entropy against the target's soft law: it starts near log 48 = 3.87 (uniform) and its floor is the
    # law's entropy; 40 steps take the mean of 10 down by 0.07
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.05
    assert log["held_out_after"]["loss"] < log["held_out_before"]["loss"]
    assert log["held_out_after"]["agreement"] > log["held_out_before"]["agreement"]
    whole, vocab_ids, _, _ = load_head(tmp_path / "whole", "draft")
    assert isinstance(whole, RecurrentDraft) and whole.config.arch == "gru" and vocab_ids == vocab

    class Stop(Exception):
        pass

    def stop_at_25(step, entry):
        if step == 25:
            raise Stop

    with pytest.raises(Stop):
        train("cut", progress=stop_at_25)
    assert load_checkpoint(tmp_path / "cut" / CHECKPOINT)["step"] == 20
    with pytest.raises(ConfigError, match="arch: 'gru' in the checkpoint, 'lstm' asked"):
        train("cut", config=replace(config, arch="lstm"), resume=True)
    resumed_log = train("cut", resume=True)
    assert [e["step"] for e in resumed_log["loss"]] == list(range(1, 41))
    resumed = load_head(tmp_path / "cut", "draft")[0]
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))

    held = [s[:6] for s in sequences[20:]]
    plain = SpeculativeEngine(target).generate_ids(held, max_new_tokens=20, eos_token_ids=())
    drafter = DistilledDrafter.for_target(target, path=str(tmp_path / "whole"))
    assert isinstance(drafter.model, RecurrentLM)
    # fixed draft lengths: the cost policy reads the clock, and on a loaded machine it may stop drafting
    spec = SpeculativeEngine(target, drafter).generate_ids(held, max_new_tokens=20, num_draft_tokens=3,
                                                           draft_length="fixed", eos_token_ids=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.accepted_tokens for s in spec) > 0


def test_a_checkpoint_written_before_drafts_had_an_arch_resumes_as_a_transformer(tmp_path):
    """A shape field the checkpoint lacks is the field's default (the draft's ``arch``: transformer)."""
    config = DraftConfig(64, 10)
    saved = {key: value for key, value in config.as_dict().items() if key != "arch"}
    torch.save({"head": {}, "optimizer": {}, "schedule": {}, "generator": torch.Generator().get_state(), "step": 1,
                "log": {"config": saved}}, tmp_path / CHECKPOINT)
    assert resumable_state(tmp_path, config)["step"] == 1
    with pytest.raises(ConfigError, match="arch: 'transformer' in the checkpoint, 'gru' asked"):
        resumable_state(tmp_path, replace(config, arch="gru"))


# ------------------------------------------------------------------------------ command line and server
@pytest.fixture(scope="module")
def saved_draft(tiny_model_dir, tmp_path_factory):
    """A random-weight 2-layer GRU draft saved for the tiny saved model (its fingerprint), over 200 of its tokens."""
    target = genspec.load_model(str(tiny_model_dir))
    out = tmp_path_factory.mktemp("recurrent") / "gru"
    vocab = list(range(3, 203))
    save_head(out, _draft(vocab, "gru", dtype=torch.float32), vocab, target_fingerprint(target))
    return out


def test_generate_with_a_recurrent_draft_and_bad_options_refused(capsys, tiny_model_dir, saved_draft):
    from genspec.cli import main

    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "the cat sat", "--max-new-tokens", "12", "--json"]
    assert main(base + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    for extra in (["--drafter", "draft", "-O", f"path={saved_draft}"],
                  ["--drafter", "draft-model", "--draft-model", str(saved_draft)]):
        assert main(base + extra + ["-k", "3", "--draft-length", "fixed"]) == 0
        spec = json.loads(capsys.readouterr().out)
        assert spec["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
        assert spec["stats"]["drafted_tokens"] > 0
    for option, message in (("num_drafts=0", "num_drafts=0: expected an integer from 1 to 32"),
                            ("confidence_threshold=1.5", "confidence_threshold=1.5: expected a number in [0, 1)"),
                            ("layers=2", "does not take option")):
        assert main(base + ["--drafter", "draft", "-O", f"path={saved_draft}", "-O", option]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_a_server_request_picks_the_recurrent_draft_by_name(tiny_model_dir, saved_draft):
    from fastapi.testclient import TestClient

    from genspec.serve.app import create_app
    from genspec.serve.settings import ServerSettings

    engine = genspec.load(str(tiny_model_dir), drafter="none", extra_drafters={"draft": {"path": str(saved_draft)}})
    body = {"model": "tiny", "prompt": "the cat sat", "max_tokens": 10, "temperature": 0}
    with TestClient(create_app(engine, ServerSettings(served_model_name="tiny"))) as client:
        plain = client.post("/v1/completions", json=body).json()
        spec = client.post("/v1/completions", json={**body, "speculative": {
            "drafter": "draft", "num_draft_tokens": 3, "draft_length": "fixed"}}).json()
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spec["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0


def test_genspec_train_draft_arch_gru_then_generate_with_it(capsys, tmp_path, tiny_model_dir):
    """The command end to end (2 steps): ``--arch gru`` writes a recurrent draft that ``--drafter draft`` loads
    (greedy = plain); resuming it as an LSTM, or an unknown arch, is refused in one line."""
    from genspec.cli import main

    out = tmp_path / "draft"
    argv = ["train", "draft", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "2", "--prompts", "2",
            "--max-new-tokens", "8", "--vocab-size", "64", "--width", "32", "--layers", "1", "--arch", "gru"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "draft written to" in err and "held-out acceptance" in err
    draft, _, _, info = load_head(out, "draft")
    assert isinstance(draft, RecurrentDraft) and draft.config.arch == "gru" and info["log"]["config"]["arch"] == "gru"
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "the cat sat", "--max-new-tokens", "12", "--json"]
    assert main(base + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--drafter", "draft", "-O", f"path={out}", "-k", "3", "--draft-length", "fixed"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert main(argv[:-1] + ["lstm", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "another shape (arch: 'gru' in the checkpoint, 'lstm' asked)" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as exit_:
        main(argv[:-1] + ["rnn"])
    assert exit_.value.code == 2 and "invalid choice: 'rnn'" in capsys.readouterr().err
