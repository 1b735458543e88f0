"""``genspec calibrate`` on a tiny saved model: files written, read back by the drafters."""
from __future__ import annotations

import json

import pytest

import genspec
from genspec.cli import main


@pytest.mark.parametrize("what, key", [("early-exit", "exit_layer"), ("layer-skip", "skip")])
def test_calibrate_self_speculation(tmp_path, tiny_model_dir_4_layers, what, key):
    out = tmp_path / f"{what}.json"
    assert main(["calibrate", what, "--model", str(tiny_model_dir_4_layers), "--out", str(out),
                 "--tokens", "6"]) == 0
    data = json.loads(out.read_text())
    assert key in data and 0.0 <= data["alpha"] <= 1.0 and data["candidates"]
    best = max(c["predicted_speedup"] for c in data["candidates"])
    assert data["predicted_speedup"] >= min(best, 1.0) - 1e-12
    target = genspec.load_model(str(tiny_model_dir_4_layers))
    option = {"exit_layer": str(out)} if what == "early-exit" else {"skip": str(out)}
    drafter = genspec.build_drafter(what, target, **option)
    expected = data["exit_layer"] if what == "early-exit" else 4 - len(data["skip"])
    assert len(drafter.model._decoder.layers) == expected


def test_draft_vocab_from_corpus(tmp_path, tiny_model_dir_4_layers):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("aaaa bbb cc d " * 20)
    out = tmp_path / "vocab.json"
    assert main(["calibrate", "draft-vocab", "--model", str(tiny_model_dir_4_layers), "--corpus", str(corpus),
                 "--size", "3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    target = genspec.load_model(str(tiny_model_dir_4_layers))
    a, space = target.tokenizer("a")["input_ids"][0], target.tokenizer(" ")["input_ids"][0]
    assert {a, space} <= set(data["token_ids"])
    assert 0.5 < data["coverage"] <= 1.0


def test_draft_vocab_bad_corpus(tmp_path, tiny_model_dir_4_layers, capsys):
    assert main(["calibrate", "draft-vocab", "--model", str(tiny_model_dir_4_layers), "--corpus",
                 str(tmp_path / "none.txt"), "--out", str(tmp_path / "v.json")]) == 2
    assert "corpus file not found" in capsys.readouterr().err
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00\x80" * 10)
    assert main(["calibrate", "draft-vocab", "--model", str(tiny_model_dir_4_layers), "--corpus", str(binary),
                 "--out", str(tmp_path / "v.json")]) == 2
    assert "UTF-8" in capsys.readouterr().err


def test_measure_verify_costs_fills_the_cost_model_and_leaves_the_target_empty(tiny_target):
    """Every (batch, width) measured gets a positive cost; the context is clipped to the model's 256
    tokens (asking for 1000 must not fail), and no row is left behind for the engine to trip over."""
    from genspec.calibration import measure_verify_costs
    from genspec.draft_length import CostModel

    costs, seen = CostModel(), []
    measure_verify_costs(tiny_target, costs, batches=(1, 3), widths=(1, 4), context=1000, repeats=1,
                         progress=seen.append)
    for batch in (1, 3):
        for width in (1, 4):
            assert costs.verify_cost(width, batch) > 0
    assert tiny_target.num_rows == 0 and len(seen) == 2


def test_calibrate_engine_times_every_width_of_an_uneven_target_and_the_grid_of_a_smooth_one(tiny_target):
    """A target whose verify cost is uneven in the block width (llama.cpp) gets every width a draft can fill
    timed at one row (the drafter's k + 1), and up to ``UNEVEN_BATCH_WIDTHS`` at more rows; a smooth one the
    grid only (the cost model interpolates between its widths)."""
    from genspec.calibration import GRID_WIDTHS, UNEVEN_BATCH_WIDTHS, calibrate_engine
    from genspec.engine import SpeculativeEngine

    drafter = genspec.build_drafter("suffix", tiny_target)  # drafts up to 24 tokens
    deepest = drafter.capabilities.default_draft_tokens
    smooth = SpeculativeEngine(tiny_target, drafter)
    calibrate_engine(smooth, batches=(1, 2))
    assert set(smooth.costs.verify) == {(b, w) for b in (1, 2) for w in GRID_WIDTHS}

    tiny_target.uneven_verify_cost = True  # this instance only
    try:
        uneven = SpeculativeEngine(tiny_target, drafter)
        calibrate_engine(uneven, batches=(1, 2))
        assert set(uneven.costs.verify) == ({(1, w) for w in range(1, deepest + 2)}
                                            | {(2, w) for w in range(1, UNEVEN_BATCH_WIDTHS + 1)})
        shallow = SpeculativeEngine(tiny_target, drafter)
        calibrate_engine(shallow, deepest=3)
        assert set(shallow.costs.verify) == {(1, w) for w in range(1, 5)}
    finally:
        del tiny_target.uneven_verify_cost
    assert tiny_target.num_rows == 0


def test_a_server_times_the_usual_batch_sizes_up_to_its_largest_and_the_largest():
    from genspec.calibration import served_batches

    assert served_batches(12) == [1, 2, 4, 8, 12]
    assert served_batches(16) == [1, 2, 4, 8, 16]
    assert served_batches(3) == [1, 2, 3]
    assert served_batches(1) == [1]
