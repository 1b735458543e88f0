"""Files genspec reads back load without pickle: a training checkpoint that needs pickle is refused with a
clear error, and none of its code runs."""
from __future__ import annotations

import pickle

import pytest
import torch
from tiny_models import sampled_continuations, tiny_llama

from genspec.errors import InputFileError
from genspec.models import HFCausalLM
from genspec.speculators.head import HeadConfig
from genspec.train.data import choose_vocabulary, record_features
from genspec.train.loop import CHECKPOINT, load_checkpoint, train_head
from genspec.train.settings import TrainSettings


class _Payload:
    """Unpickling it writes a file: the proof that loading ran code the checkpoint named."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _pickled_checkpoint(path, marker) -> None:
    with open(path, "wb") as handle:
        torch.save({"head": {}, "step": 1, "payload": _Payload(marker)}, handle, pickle_module=pickle)


def test_a_checkpoint_that_needs_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    _pickled_checkpoint(tmp_path / CHECKPOINT, marker)
    with pytest.raises(InputFileError, match="only pickle can load") as refused:
        load_checkpoint(tmp_path / CHECKPOINT)
    assert "\n" not in str(refused.value) and str(tmp_path / CHECKPOINT) in str(refused.value)
    assert not marker.exists()


def test_a_plain_checkpoint_loads(tmp_path):
    state = {"head": {"w": torch.ones(2)}, "step": 3, "log": {"loss": [{"step": 1, "loss": 0.5}], "name": "x"},
             "generator": torch.Generator().manual_seed(0).get_state()}
    torch.save(state, tmp_path / CHECKPOINT)
    loaded = load_checkpoint(tmp_path / CHECKPOINT)
    assert loaded["step"] == 3 and loaded["log"] == state["log"] and torch.equal(loaded["head"]["w"], torch.ones(2))


def test_resuming_from_a_pickled_checkpoint_is_refused(tmp_path):
    """``train_head(resume=True)`` (what ``genspec train --resume`` calls) over a planted checkpoint."""
    target = HFCausalLM(tiny_llama(0, dtype=torch.float32))
    sequences = sampled_continuations(target)[:6]
    data = record_features(target, sequences)
    out = tmp_path / "head"
    out.mkdir()
    marker = tmp_path / "ran"
    _pickled_checkpoint(out / CHECKPOINT, marker)
    config = HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
    with pytest.raises(InputFileError, match="only pickle can load"):
        train_head(target, data[:4], data[4:], choose_vocabulary(sequences, 48), out, config=config,
                   settings=TrainSettings(steps=4, batch_size=2, sequence_length=16), resume=True)
    assert not marker.exists()
