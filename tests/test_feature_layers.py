"""A draft head whose committed pairs fuse the target's final feature with the outputs of some of its layers
(``HeadConfig.feature_layers``, EAGLE-3's fused features): the target returns exactly transformers'
``hidden_states[l]`` after its final states, the engine hands each drafter the layers it reads, and the
drafter's cached drafting equals the head's whole-sequence forward. Training, greedy equality and the
chi-square lossless test of such heads (chains and trees) are cases of tests/test_draft_head.py's."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import draft_one_pair, tiny_llama

from genspec.drafters.base import Draft, Drafter, DrafterCapabilities, RequestContext
from genspec.drafters.head import HeadDrafter
from genspec.engine import SpeculativeEngine
from genspec.requests import own_hidden
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.speculators.head import DraftHead, HeadConfig
from genspec.train.data import record_features

SMALL = HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, feature_layers=(1,))


def _states(model, sequence: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The final hidden states (the LM head's input), then transformers' ``hidden_states[l]`` of each of
    ``layers``, over the whole sequence: ``[n, H * (1 + len(layers))]``."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([sequence]), output_hidden_states=True)
    return torch.cat([out.hidden_states[-1][0]] + [out.hidden_states[layer][0] for layer in layers], -1)


def test_the_target_returns_its_layers_outputs_after_its_final_states():
    model = tiny_llama(0, layers=3)
    target = HFCausalLM(model)
    a, b = [5, 9, 11, 3, 7, 7, 2], [9, 9, 12]
    hidden = target.add_rows([a[:4], b[:2]], return_hidden=True, hidden_layers=(2, 1))
    assert torch.allclose(hidden[0], _states(model, a[:4], (2, 1)), atol=1e-10)
    assert torch.allclose(hidden[1], _states(model, b[:2], (2, 1)), atol=1e-10)
    tokens = torch.tensor([a[4:7], b[2:3] + [0, 0]])
    valid = torch.tensor([[True] * 3, [True, False, False]])
    logits, more = target.forward(tokens, valid, return_hidden=True, hidden_layers=(2, 1))
    assert more.shape == (2, 3, 3 * 64)
    assert torch.allclose(more[0], _states(model, a, (2, 1))[4:], atol=1e-10)
    assert torch.allclose(more[1, :1], _states(model, b, (2, 1))[2:], atol=1e-10)
    assert torch.allclose(logits[valid], target.head(more[valid][:, :64]))  # the logits come from the final states
    for bad in [(0,), (3,)]:
        with pytest.raises(ConfigError, match="not available from this 3-layer model"):
            target.forward(tokens, valid, return_hidden=True, hidden_layers=bad)


class _Recorder(Drafter):
    """Reads the target's hidden states with some of its layers; proposes the known greedy continuation
    with every third token wrong (so drafts are partly kept)."""

    name = "recorder"

    def __init__(self, layers: tuple[int, ...], continuations: dict[int, list[int]]):
        self.capabilities = DrafterCapabilities(reads_target_hidden=True, target_hidden_layers=layers)
        self.continuations = continuations
        self.hidden: dict[int, list[torch.Tensor]] = {}

    def start(self, contexts):
        for c in contexts:
            self.hidden[c.request_id] = [c.hidden]

    def propose(self, requests):
        chains = []
        for r in requests:
            if r.hidden is not None:
                self.hidden[r.request_id].append(r.hidden)
            known = self.continuations[r.request_id][len(r.sequence):len(r.sequence) + r.max_tokens]
            chains.append([[t if (len(r.sequence) + i) % 3 else 0 for i, t in enumerate(known)]])
        return Draft.from_chains(chains)


def test_the_engine_hands_a_drafter_the_layers_it_reads():
    model = tiny_llama(0, layers=3)
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9]]
    plain = SpeculativeEngine(HFCausalLM(model)).generate_ids(prompts, max_new_tokens=12, eos_token_ids=())
    recorder = _Recorder((2,), {i: p + r.token_ids for i, (p, r) in enumerate(zip(prompts, plain))})
    results = SpeculativeEngine(HFCausalLM(model), recorder).generate_ids(
        prompts, max_new_tokens=12, num_draft_tokens=3, draft_length="fixed", eos_token_ids=())
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert 0 < sum(r.stats.accepted_tokens for r in results) < sum(r.stats.drafted_tokens for r in results)
    for request_id, (prompt, result) in enumerate(zip(prompts, results)):
        got = torch.cat(recorder.hidden[request_id])
        expected = _states(model, prompt + result.token_ids, (2,))
        assert got.shape[1] == 128 and len(got) >= len(prompt) + 6
        assert torch.allclose(got, expected[:len(got)], atol=1e-9)


def test_a_request_gets_the_final_states_and_its_own_layers_of_a_wider_pass():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float64).view(2, 12)  # final, then layers 1, 2, 5 (width 3)
    final, one, two, five = hidden.split(3, dim=-1)
    assert torch.equal(own_hidden(hidden, (1, 2, 5), (1, 2, 5)), hidden)
    assert torch.equal(own_hidden(hidden, (1, 2, 5), ()), final)
    assert torch.equal(own_hidden(hidden, (1, 2, 5), (5, 1)), torch.cat([final, five, one], -1))


def test_cached_drafting_equals_the_whole_sequence_forward(tiny_target):
    """Committed pairs (fused features, next token's embedding) fed in two chunks, then a drafted pair (the
    predicted feature, the drafted token's embedding), give what the head's forward over whole sequences
    gives: its committed half for the first draft token, its drafted half for the next ones."""
    torch.manual_seed(0)
    head = DraftHead(SMALL).to(torch.float64).eval()
    drafter = HeadDrafter(tiny_target, head, list(range(64)), tree_nodes=0)
    assert drafter.capabilities.target_hidden_layers == (1,)
    sequence = [5, 9, 11, 3, 7, 7, 2, 40, 41, 13]
    tiny_target.reset(0)
    [features] = tiny_target.add_rows([sequence[:-1]], return_hidden=True, hidden_layers=(1,))
    tiny_target.reset(0)
    embed = tiny_target.model.get_input_embeddings()
    with torch.no_grad():
        committed, _ = head(features.unsqueeze(0), embed(torch.tensor([sequence[1:]])))
    drafter.start([RequestContext(0, sequence[:4], hidden=features[:3])])
    row = drafter._rows[0]
    with torch.no_grad():
        first = drafter._sync([row], [sequence[:4]])
        row.features = features
        second = drafter._sync([row], [sequence])
    assert torch.allclose(first[0], committed[0, 2], atol=1e-9)
    assert torch.allclose(second[0], committed[0, 8], atol=1e-9)
    token = 17
    with torch.no_grad():
        # the forward's drafted pair i reads drafted_features[i]: here the predicted feature at the end
        pairs = torch.cat([features, torch.zeros(1, 128, dtype=features.dtype)]).unsqueeze(0)
        drafted_features = torch.cat([features[:, :64], second.view(1, -1)]).unsqueeze(0)
        _, drafted = head(pairs, embed(torch.tensor([sequence[1:] + [token]])), drafted_features=drafted_features)
    out = draft_one_pair(drafter, row, second, len(sequence) - 1, token)
    assert torch.allclose(out, drafted[0, -1], atol=1e-9)


def test_recorded_features_hold_the_final_features_then_the_layers_then_the_token_states(tiny_target):
    sequence = [5, 9, 11, 3, 7, 7, 2, 40]
    [(_, features)] = record_features(tiny_target, [sequence], token_layers=1, feature_layers=(1,))
    [(_, fused)] = record_features(tiny_target, [sequence], feature_layers=(1,))
    [(_, with_states)] = record_features(tiny_target, [sequence], token_layers=1)
    assert features.shape == (7, 192)
    assert torch.allclose(fused, _states(tiny_target.model, sequence[:-1], (1,)).float(), atol=1e-5)
    assert torch.equal(features[:, :128], fused) and torch.equal(features[:, 128:], with_states[:, 64:])


def test_a_fused_head_saved_and_loaded_keeps_its_layers(tmp_path, tiny_target):
    from genspec.speculators.store import load_head, save_head, target_fingerprint

    head = DraftHead(replace(SMALL, feature_layers=[1]))  # a list (as JSON gives it) becomes a tuple
    assert head.config.feature_layers == (1,) and head.config.feature_width == 128
    save_head(tmp_path / "h", head, list(range(64)), target_fingerprint(tiny_target))
    loaded = load_head(tmp_path / "h")[0]
    assert loaded.config == head.config and loaded.splits
    assert HeadDrafter.for_target(tiny_target, path=str(tmp_path / "h")).capabilities.target_hidden_layers == (1,)
