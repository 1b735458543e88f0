"""A draft head whose committed pairs read the target's first L layers over the next token
(``HeadConfig.token_layers``, :mod:`genspec.drafters.layer_states`): exact states, the drafter's cache
equal to the whole-sequence forward. Training, greedy equality and the chi-square lossless test of such
heads (chains and trees) are cases of tests/test_draft_head.py's."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import draft_one_pair, tiny_llama

from genspec.drafters.base import RequestContext
from genspec.drafters.head import HeadDrafter
from genspec.drafters.layer_states import LayerStates
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.models.variants import first_layers
from genspec.speculators.head import DraftHead, HeadConfig
from genspec.train.data import record_features
from genspec.train.losses import Teacher, head_loss
from genspec.train.settings import TrainSettings

SMALL = HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, token_layers=1)


def _head(seed: int = 0, layers: int = 1) -> DraftHead:
    torch.manual_seed(seed)
    return DraftHead(replace(SMALL, num_layers=layers)).to(torch.float64).eval()


def _layer_state(model, sequence: list[int], layer: int) -> torch.Tensor:
    """transformers' own ``hidden_states[layer]`` over the whole sequence, ``[n, H]``."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([sequence]), output_hidden_states=True).hidden_states[layer][0]


def test_layer_states_read_in_steps_equal_the_whole_sequence_states():
    """Two requests read in chunks of different sizes (one finishes, another joins) give transformers'
    hidden_states[L] of each whole sequence: the un-normed output of the target's first L layers."""
    model = tiny_llama(0, layers=3)
    target = HFCausalLM(model)
    states = LayerStates(target, 2)
    a, b, c = [5, 9, 11, 3, 7, 7, 2, 40], [9, 9, 12, 1, 30], [4, 4, 4, 8]
    got = {0: [], 1: [], 2: []}
    for request_ids, sequences in [([0, 1], [a[:3], b[:2]]), ([1], [b[:4]]), ([0, 1], [a[:7], b])]:
        for i, s in zip(request_ids, states.read(request_ids, sequences)):
            got[i].append(s)
    states.finish([1])
    for i, s in zip([2, 0], states.read([2, 0], [c, a])):
        got[i].append(s)
    for i, sequence in [(0, a), (1, b), (2, c)]:
        assert torch.allclose(torch.cat(got[i]), _layer_state(model, sequence, 2), atol=1e-10)
    assert states.unread(0, a + [3]) == 1 and states.unread(7, a) == len(a)
    with pytest.raises(ConfigError, match="must be in 1..2"):
        first_layers(target, 3)


def test_recorded_features_hold_the_final_features_then_the_layer_states(tiny_target):
    sequence = [5, 9, 11, 3, 7, 7, 2, 40]
    [(tokens, features)] = record_features(tiny_target, [sequence], token_layers=1)
    assert tokens.tolist() == sequence and features.shape == (7, 128)
    assert torch.allclose(features[:, 64:], _layer_state(tiny_target.model, sequence[:-1], 1).float(), atol=1e-5)
    [(_, plain)] = record_features(tiny_target, [sequence])
    assert torch.equal(features[:, :64], plain)


def test_cached_drafting_equals_the_whole_sequence_forward(tiny_target):
    """Committed pairs (feature, next token's layer state) fed in two chunks, then drafted pairs (predicted
    feature, drafted token's embedding), give what the head's forward over whole sequences gives: its
    committed half for the first draft token, its drafted half for the next ones."""
    head = _head()
    drafter = HeadDrafter(tiny_target, head, list(range(64)), tree_nodes=0)
    sequence = [5, 9, 11, 3, 7, 7, 2, 40, 41, 13]
    tiny_target.reset(0)
    [features] = tiny_target.add_rows([sequence[:-1]], return_hidden=True)
    tiny_target.reset(0)
    states = _layer_state(tiny_target.model, sequence, 1)
    embed = tiny_target.model.get_input_embeddings()
    with torch.no_grad():
        committed, _ = head(features.unsqueeze(0), embed(torch.tensor([sequence[1:]])), states[1:].unsqueeze(0))
    drafter.start([RequestContext(0, sequence[:4], hidden=features[:3])])
    row = drafter._rows[0]
    row.states = drafter.layer_states.read([0], [sequence[:4]])[0]
    with torch.no_grad():
        first = drafter._sync([row], [sequence[:4]])
        row.features = features
        row.states = torch.cat([row.states, drafter.layer_states.read([0], [sequence])[0]])
        second = drafter._sync([row], [sequence])
    assert torch.allclose(first[0], committed[0, 2], atol=1e-9)
    assert torch.allclose(second[0], committed[0, 8], atol=1e-9)
    # one drafted pair after the committed ones: the forward's drafted half at that position
    token = 17
    with torch.no_grad():
        pairs = torch.cat([features, second]).unsqueeze(0)
        _, drafted = head(pairs, embed(torch.tensor([sequence[1:] + [token]])),
                          torch.cat([states[1:], torch.zeros(1, 64, dtype=states.dtype)]).unsqueeze(0))
    out = draft_one_pair(drafter, row, second, len(sequence) - 1, token)
    assert torch.allclose(out, drafted[0, -1], atol=1e-9)


def test_drafted_pairs_train_on_the_heads_own_predicted_features():
    """EAGLE-3's training-time test: the drafted half of the loss reads, for pair i, the head's prediction of
    feature i from committed pair i - 1 (what the drafter's first drafted pair reads), not the target's."""
    head = _head(seed=3)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 6, 128, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, 64, (2, 7), generator=generator)
    mask = torch.ones(2, 5, dtype=torch.bool)
    table = torch.randn(64, 64, generator=generator, dtype=torch.float64)
    teacher = Teacher(logits_of=lambda f: f @ table.T, embed=lambda t: table[t], to_local=torch.arange(64))
    exact, states, wanted = features[:, :-1, :64], features[:, 1:, 64:], features[:, 1:, :64]
    embeddings = table[tokens[:, 1:-1]]
    with torch.no_grad():
        committed, _ = head(exact, embeddings, states)
        assert torch.allclose(head(exact, embeddings, states, own_predictions=True)[0], committed, atol=1e-12)
        own = torch.cat([exact[:, :1], committed[:, :-1]], dim=1)
        _, drafted = head(exact, embeddings, states, drafted_features=own)
        _, with_target_features = head(exact, embeddings, states, drafted_features=exact)
    quiet = TrainSettings(noise=0.0)
    loss = head_loss(head, teacher, tokens, features, mask, quiet)[0]
    regression = lambda predicted: torch.nn.functional.smooth_l1_loss(predicted, wanted, reduction="none").mean()
    ce = lambda predicted: -(teacher.logits_of(wanted).softmax(-1) * teacher.logits_of(predicted).log_softmax(-1)).sum(-1).mean()
    half = lambda predicted: regression(predicted) + quiet.classification_weight * ce(predicted)
    assert torch.allclose(loss, half(committed) + half(drafted), atol=1e-9)
    old = head_loss(head, teacher, tokens, features, mask, TrainSettings(noise=0.0, own_drafted_features=False))[0]
    assert torch.allclose(old, half(committed) + half(with_target_features), atol=1e-9)
    assert not torch.allclose(loss, old)
