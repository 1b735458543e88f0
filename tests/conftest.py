"""Fixtures shared by several test files: tiny models saved to disk and a tiny in-memory target.

Session-scoped, so each is built once per run. Tests only read them: the saved directories are
never written to, and an engine built on ``tiny_target`` resets its rows, every test running its
requests to completion. Model-building helpers live in tiny_models.py, statistics in stats_helpers.py.
"""
from __future__ import annotations

import pytest
from tiny_models import save_tiny_model, tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama (seed 0, 2 layers, float32) with the byte tokenizer, saved to disk."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_models") / "target", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_model_dir):
    """``(target, draft)``: ``tiny_model_dir`` and a draft model saved beside it (seed 1, 1 layer)."""
    return tiny_model_dir, save_tiny_model(tmp_path_factory.mktemp("tiny_models") / "draft", seed=1, layers=1)


@pytest.fixture(scope="session")
def tiny_model_dir_4_layers(tmp_path_factory):
    """Like ``tiny_model_dir`` with 4 layers (seed 0), for calibration searches over layers."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_models") / "target_4_layers", seed=0, layers=4)


@pytest.fixture(scope="session")
def tiny_target():
    """``HFCausalLM(tiny_llama(0))``: float64, vocabulary 64, 2 layers, context 256, no tokenizer."""
    from genspec.models import HFCausalLM

    return HFCausalLM(tiny_llama(0))
