"""Drafters on the target's features (head, Medusa) on the llama.cpp backend, on tiny GGUF files written in the
test: llama.cpp's final hidden states are the ones transformers computes and, on exact kernels, do not depend on
the block or batch that computes them; the token embeddings and output-layer rows a head reads come from the file
as transformers loads them (so a head trained on the torch copy of a GGUF model is its head on llama.cpp too);
greedy speculation with a head equals plain decoding (batch 1 and 4, chains and trees); sampled outputs follow
the exact law (chi-square)."""
from __future__ import annotations

import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")

from test_draft_head import _head  # noqa: E402
from test_llamacpp import assert_samples_follow_the_exact_law  # noqa: E402
from test_medusa import _heads  # noqa: E402
from tiny_gguf import write_tiny_gguf  # noqa: E402

import genspec  # noqa: E402
from genspec.drafters.head import HeadDrafter  # noqa: E402
from genspec.drafters.medusa import MedusaDrafter  # noqa: E402
from genspec.engine import SpeculativeEngine  # noqa: E402
from genspec.errors import ConfigError  # noqa: E402
from genspec.models import HFCausalLM  # noqa: E402
from genspec.models.llamacpp import LlamaCppLM  # noqa: E402
from genspec.speculators.head import DraftHead, HeadConfig  # noqa: E402
from genspec.speculators.store import target_fingerprint  # noqa: E402

PROMPT = [5, 9, 40, 41, 42, 7, 3, 100]
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 9, 9, 2], [3, 4, 40, 41], [11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def float_gguf(tmp_path_factory):
    """(path, transformers model, tokenizer) of a tiny float32 Llama GGUF."""
    path = tmp_path_factory.mktemp("heads") / "tiny.gguf"
    model, tokenizer = write_tiny_gguf(path, seed=0, scale=4.0)
    return path, model, tokenizer


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    """(path, tokenizer) of the same tiny Llama in Q8_0, which exact kernels compute batch-invariantly."""
    path = tmp_path_factory.mktemp("heads") / "tiny-q8.gguf"
    _, tokenizer = write_tiny_gguf(path, seed=0, scale=4.0, weight_type="Q8_0")
    return path, tokenizer


@pytest.fixture(scope="module")
def q8_target(q8_gguf):
    path, tokenizer = q8_gguf
    return LlamaCppLM(path, tokenizer, context=256, max_rows=4, threads=1)


def test_final_states_are_what_transformers_computes(float_gguf):
    """A prefill's states and a block's are transformers' final hidden states (after the final norm) within
    5e-3 (exact kernels' bf16 KV cache), the last ``hidden_last`` of a prefill when asked for fewer; states of
    padding are zero."""
    path, model, tokenizer = float_gguf
    with torch.no_grad():
        reference = model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states[-1][0]
    lm = LlamaCppLM(path, tokenizer, context=64, max_rows=2, threads=1)
    assert lm.hidden_size == reference.shape[-1]
    states = lm.add_rows([PROMPT[:5], PROMPT[:3]], return_hidden=True)
    assert [tuple(s.shape) for s in states] == [(5, 64), (3, 64)]
    assert (states[0] - reference[:5]).abs().max() < 5e-3 and (states[1] - reference[:3]).abs().max() < 5e-3
    logits, hidden = lm.forward(torch.tensor([PROMPT[5:], [PROMPT[3], 0, 0]]),
                                valid=torch.tensor([[True] * 3, [True, False, False]]), return_hidden=True)
    assert hidden.shape == (2, 3, 64) and logits.shape == (2, 3, lm.vocab_size)
    assert (hidden[0] - reference[5:]).abs().max() < 5e-3 and (hidden[1, 0] - reference[3]).abs().max() < 5e-3
    assert not hidden[1, 1:].any()
    lm.reset(0)
    last = lm.add_rows([PROMPT, PROMPT[:2]], return_hidden=True, hidden_last=3)
    assert [tuple(s.shape) for s in last] == [(3, 64), (2, 64)]
    assert (last[0] - reference[5:]).abs().max() < 5e-3 and (last[1] - reference[:2]).abs().max() < 5e-3


def test_states_and_logits_do_not_depend_on_the_block_or_batch(q8_target):
    """On exact kernels (Q8_0) a position's state and logits are bitwise the same from one-token steps, from a
    4-token block, beside three other rows, and from a prefill's last states; asking for states leaves the
    logits bitwise as they were."""
    lm, block = q8_target, [17, 18, 19, 20]
    assert lm.batch_invariant

    def steps(states: bool):
        lm.reset(0)
        lm.add_rows([PROMPT])
        out = []
        for token in block:
            out.append(lm.forward(torch.tensor([[token]]), return_hidden=states))
            lm.commit_all()
        return out

    alone = steps(True)
    step_logits = torch.cat([logits[0] for logits, _ in alone])
    step_states = torch.cat([hidden[0] for _, hidden in alone])
    assert torch.equal(torch.cat([logits[0] for logits in steps(False)]), step_logits)
    lm.reset(0)
    lm.add_rows([PROMPT])
    logits, hidden = lm.forward(torch.tensor([block]), return_hidden=True)
    assert torch.equal(logits[0], step_logits) and torch.equal(hidden[0], step_states)
    lm.reset(0)
    lm.add_rows([PROMPT, PROMPT[:5], PROMPT[2:], [7, 7, 7]])
    others = [block, [30, 31, 32, 33], [34, 35, 36, 37], [38, 39, 40, 41]]
    logits, hidden = lm.forward(torch.tensor(others), return_hidden=True)
    assert torch.equal(logits[0], step_logits) and torch.equal(hidden[0], step_states)
    lm.reset(0)
    assert torch.equal(lm.add_rows([PROMPT + block], return_hidden=True, hidden_last=4)[0], step_states)


def test_a_heads_inputs_come_from_the_file_as_transformers_loads_it(float_gguf):
    """The token embeddings (scaled as the model scales them), the output layer's rows, a truncated head's
    logits and the fingerprint a trained head is checked by are the transformers model's, so a head trained on
    the torch copy of a GGUF model drafts for it on llama.cpp."""
    path, model, tokenizer = float_gguf
    gguf_lm = LlamaCppLM(path, tokenizer, context=256, max_rows=1, threads=1)
    torch_lm = HFCausalLM(model, tokenizer)
    tokens = torch.tensor([[3, 200], [7, 9]])
    assert gguf_lm.embedding_scale == 1.0  # a Llama does not scale its embeddings (Gemma: the square root of H)
    assert torch.equal(gguf_lm.token_embeddings(tokens), torch_lm.token_embeddings(tokens))
    ids = torch.tensor([0, 17, 259])
    assert torch.equal(gguf_lm.output_rows(ids), torch_lm.output_rows(ids))
    hidden = torch.randn(2, 64)
    assert torch.allclose(gguf_lm.subset_head(ids)(hidden), torch_lm.subset_head(ids)(hidden), atol=1e-5)
    assert target_fingerprint(gguf_lm) == target_fingerprint(torch_lm)


@pytest.mark.parametrize("batch, tree_nodes", [(1, 0), (4, 0), (4, 4)])
def test_greedy_head_drafting_equals_plain_decoding_on_llamacpp(q8_gguf, batch, tree_nodes):
    """A random head (it mostly disagrees with the target: equality must hold either way) drafting chains, and
    4-node trees on the shared cache trees need, gives plain decoding's tokens, and drafts."""
    path, tokenizer = q8_gguf
    lm = LlamaCppLM(path, tokenizer, context=256, max_rows=4, threads=1)
    prompts = PROMPTS[:batch]
    plain = SpeculativeEngine(lm).generate_ids(prompts, max_new_tokens=24, eos_token_ids=())
    drafter = HeadDrafter(lm, _head(dtype=torch.float32), list(range(0, 260, 2)), tree_nodes=tree_nodes)
    spec = SpeculativeEngine(lm, drafter).generate_ids(prompts, max_new_tokens=24, num_draft_tokens=3,
                                                       eos_token_ids=(), draft_length="fixed")
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.drafted_tokens for s in spec) > 0


def test_greedy_medusa_equals_plain_decoding_on_llamacpp(q8_target):
    """Medusa reads the prompt's last state only (``prompt_states``: 1) and drafts with it."""
    prompts = PROMPTS
    plain = SpeculativeEngine(q8_target).generate_ids(prompts, max_new_tokens=16, eos_token_ids=())
    drafter = MedusaDrafter(q8_target, _heads(64, 3).float(), list(range(260)))
    assert drafter.capabilities.prompt_states == 1
    spec = SpeculativeEngine(q8_target, drafter).generate_ids(prompts, max_new_tokens=16, num_draft_tokens=3,
                                                              eos_token_ids=(), draft_length="fixed")
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.drafted_tokens for s in spec) > 0


def test_head_sampling_is_lossless_on_llamacpp(tmp_path):
    """A sampled head chain (its law, over 8 of the 12 tokens, goes to the verifier) on a GGUF target: N = 20,000
    joint samples of 3 tokens follow the model's exact law, chi-square p > 1e-3 (the helper's test)."""
    path = tmp_path / "small.gguf"
    write_tiny_gguf(path, seed=0, layers=3, scale=8.0, vocab=12)
    lm = LlamaCppLM(path, None, context=16, max_rows=64, threads=1)
    torch.manual_seed(3)
    head = DraftHead(HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128))
    assert_samples_follow_the_exact_law(lm, HeadDrafter(lm, head, list(range(8)), tree_nodes=0))


def test_what_a_gguf_target_cannot_give_a_head_is_refused(q8_target):
    """States of the target's layers (a head trained with token or feature layers) are the torch backend's; the
    shipped head is for the embedded model only."""
    with pytest.raises(ConfigError, match="final hidden states only"):
        q8_target.add_rows([[3]], return_hidden=True, hidden_layers=(1,))
    with pytest.raises(ConfigError, match="torch backend"):
        HeadDrafter(q8_target, _head(dtype=torch.float32, token_layers=1), list(range(10)))
    with pytest.raises(ConfigError, match="needs a trained head for this model"):
        genspec.build_drafter("head", q8_target)


@pytest.mark.parametrize("kind", ["head", "draft"])
def test_a_speculator_trained_on_the_torch_copy_drafts_for_the_gguf_file(tmp_path, capsys, kind):
    """``genspec train head`` (and ``train draft``) on the transformers copy of a GGUF file, then ``genspec
    generate --model FILE.gguf --drafter head -O path=...`` on llama.cpp: the fingerprints agree, the speculator
    drafts, and greedy output equals plain decoding's."""
    import json

    from genspec.cli import main

    gguf_path, model_dir = tmp_path / "tiny.gguf", tmp_path / "tiny"
    model, tokenizer = write_tiny_gguf(gguf_path, seed=0, scale=4.0)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"the cat sat on mat number {i} and the dog sat too" for i in range(30)))
    out = tmp_path / kind
    argv = ["train", kind, "--model", str(model_dir), "--out", str(out), "--steps", "6", "--prompts", "4",
            "--max-new-tokens", "16", "--vocab-size", "64", "--data", str(corpus)]
    assert main(argv + (["--width", "32", "--layers", "1"] if kind == "draft" else [])) == 0
    capsys.readouterr()
    base = ["generate", "--model", str(gguf_path), "--prompt", "the cat sat", "--max-new-tokens", "12", "--json"]
    assert main(base + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--drafter", kind, "-O", f"path={out}", "-k", "3", "--draft-length", "fixed"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert spec["stats"]["drafted_tokens"] > 0
