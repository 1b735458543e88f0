"""Drafter options are declared once with their type and range (``Drafter.options``) and checked from there before
anything loads, through every entry point: ``check_drafter`` without a target, ``genspec generate -O``, ``genspec
bench --methods NAME:KEY=VALUE``, ``genspec serve --extra-drafter``, ``genspec demo``; size-like options have an
upper bound; ``genspec train``'s numbers are checked before the target loads (issue 62, items 4 and 5)."""
from __future__ import annotations

from pathlib import Path

import pytest

import genspec
import genspec.api
from genspec.cli import main
from genspec.drafters.base import Option
from genspec.drafters.lookahead import LookaheadDrafter
from genspec.drafters.prompt_lookup import PromptLookupDrafter
from genspec.drafters.registry import DRAFTERS, check_drafter, options_table
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models.hf import HFCausalLM
from genspec.serve.settings import ServerSettings
from genspec.train.settings import TrainSettings

REPO = Path(__file__).resolve().parents[1]

#: the issue's probes and their kin: (drafter, options, what the one-line refusal says)
REFUSED = [
    ("prompt-lookup", {"max_ngram": "x"}, "option max_ngram='x': expected an integer from 1 to 32"),
    ("prompt-lookup", {"min_ngram": "x"}, "option min_ngram='x': expected an integer from 1 to 32"),
    ("prompt-lookup", {"max_scan": "x"}, "option max_scan='x': expected an integer from 1 to 4096"),
    ("prompt-lookup", {"max_scan": -1}, "option max_scan=-1: expected an integer from 1 to 4096"),
    ("prompt-lookup", {"min_ngram": 5}, "min_ngram <= max_ngram, got 5, 4"),  # against max_ngram's default
    ("prompt-lookup", {"num_candidates": 2, "num_drafts": 2}, "not both"),
    ("suffix", {"max_nodes": "x"}, "option max_nodes='x': expected an integer from 1 to 128"),
    ("suffix", {"min_prob": "x"}, "option min_prob='x': expected a number in [0, 1]"),
    ("suffix", {"factor": "x"}, "option factor='x': expected a number in (0, 64]"),
    ("suffix", {"factor": 1e308}, "option factor=1e+308: expected a number in (0, 64]"),
    ("suffix", {"cache_tokens": 10 ** 12}, "option cache_tokens=1000000000000: expected an integer from 16 to"),
    ("ngram-cache", {"max_ngram": "x"}, "option max_ngram='x': expected an integer from 1 to 32"),
    ("ngram-cache", {"min_ratio": "x"}, "option min_ratio='x': expected a number in [0, 1]"),
    ("ngram-cache", {"renumber": False}, "does not take option renumber"),
    ("edit", {"max_ngram": "x"}, "option max_ngram='x': expected an integer from 1 to 32"),
    ("edit", {"edit_source": [1, "two"]}, "option edit_source=[1, 'two']: expected text or a list of integers >= 0"),
    ("edit", {"edit_source": "a", "edit_source_file": "b.txt"}, "not both"),
    ("lookahead", {"window": 100_000_000}, "option window=100000000: expected an integer from 0 to 64"),
    ("lookahead", {"pool_size": 10 ** 9}, "option pool_size=1000000000: expected an integer from 1 to 256"),
    ("retrieval", {}, "needs a datastore"),
    ("retrieval", {"index": "d", "min_suffix": 20}, "min_suffix <= max_suffix, got 20, 16"),
    ("head", {"tree_first": 9}, "tree_first must be an integer from 0 to min(tree_top_k, tree_nodes), got 9"),
    ("head", {"first_threshold": "abc"}, "option first_threshold='abc': expected a number in [0, 1)"),
    ("medusa", {"tree_nodes": 10 ** 6}, "option tree_nodes=1000000: expected an integer from 0 to 128"),
    ("hybrid", {"max_ngram": "x"}, "drafter 'hybrid' (lookup 'suffix') does not take option max_ngram"),
    ("hybrid", {"lookup": "prompt-lookup", "max_ngram": "x"},
     "drafter 'hybrid' (lookup 'prompt-lookup') option max_ngram='x': expected an integer from 1 to 32"),
    ("hybrid", {"lookup": "nope"}, "option lookup='nope': expected one of prompt-lookup, suffix"),
    ("hybrid", {"tree_nodes": "x"}, "drafter 'hybrid' option tree_nodes='x': expected an integer from 0 to 128"),
    ("hybrid", {"factor": 0}, "drafter 'hybrid' (lookup 'suffix') option factor=0"),
    ("draft-model", {}, "drafter 'draft-model' needs a draft model (--draft-model PATH)"),
    ("draft-model", {"draft_model": "d", "num_drafts": "x"}, "option num_drafts='x': expected an integer from 1 to 32"),
    ("draft-model", {"draft_model": "d", "min_shared": 2}, "option min_shared=2: expected a number in [0, 1]"),
    ("draft", {"confidence_threshold": 1}, "option confidence_threshold=1: expected a number in [0, 1)"),
    ("early-exit", {"exit_layer": 0}, "option exit_layer=0: expected an integer >= 1 or a path"),
    ("layer-skip", {"skip": [1, "x"]}, "option skip=[1, 'x']: expected a list of integers >= 0 or a path"),
    ("pruned", {}, "drafter 'pruned' needs a pruning plan"),
    ("hierarchical", {"levels": "prompt-lookup,pruned"}, "drafter 'pruned' needs a pruning plan"),
    ("hierarchical", {"levels": "prompt-lookup,draft-model"}, "drafter 'draft-model' needs a draft model"),
    ("hierarchical", {"levels": ["prompt-lookup", "nope"]}, "unknown or unstackable level 'nope'"),
    ("hierarchical", {"levels": "quantized,prompt-lookup"}, "level 'prompt-lookup' cannot verify another drafter"),
    ("hierarchical", {"levels": "prompt-lookup"}, "at least two levels"),
    ("none", {"max_ngram": 3}, "plain decoding and takes no options"),
]


@pytest.mark.parametrize("name, options, message", REFUSED, ids=[f"{n}-{sorted(o)}" for n, o, _ in REFUSED])
def test_the_check_refuses_without_a_target(name, options, message):
    with pytest.raises(ConfigError) as caught:
        check_drafter(name, options)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", [n for n, d in DRAFTERS.items() if d is not None])
def test_an_unknown_option_is_refused_and_the_declared_ones_are_named(name):
    with pytest.raises(ConfigError, match=f"drafter '{name}'.* does not take option bogus; it takes: "):
        check_drafter(name, {"bogus": 1})


def test_every_option_is_declared_once_and_every_size_like_one_is_bounded():
    # thresholds need no upper end; layer numbers and token ids are bounded by the target (its layers, its
    # vocabulary) when the drafter is built
    unbounded = {"min_count", "min_match", "exit_layer", "skip", "edit_source"}
    for name, drafter in DRAFTERS.items():
        declared = () if drafter is None else drafter.options
        assert len({o.name for o in declared}) == len(declared), name
        for option in declared:
            if int in option.kinds or option.item is int:
                assert option.high is not None or option.name in unbounded, (name, option.name)


def test_good_options_pass_and_values_are_typed_strictly():
    check_drafter("prompt-lookup", {"max_ngram": 32, "min_ngram": 32, "max_scan": 4096})
    check_drafter("suffix", {"factor": 3, "min_prob": 0, "cache_tokens": 100_000_000})  # an int is a number
    check_drafter("hierarchical", {"levels": ["prompt-lookup", "quantized"]})
    check_drafter("hybrid", {"lookup": "prompt-lookup", "max_ngram": 6, "tree_nodes": 0})
    option = Option("n", int, 1, 8)
    assert option.admits(3) and not option.admits(3.0) and not option.admits(True) and not option.admits("3")
    assert not Option("x", float, 0.0, 1.0).admits(float("nan"))


def test_constructors_check_their_options_by_the_same_declarations():
    with pytest.raises(ConfigError, match="option max_scan=-1: expected an integer from 1 to 4096"):
        PromptLookupDrafter(max_scan=-1)
    with pytest.raises(ConfigError, match="option window=100000000"):
        LookaheadDrafter(window=100_000_000)


def test_what_only_the_target_bounds_is_checked_when_the_drafter_is_built(tiny_target):
    with pytest.raises(ConfigError, match="edit source token id 1000000 is not in the model's vocabulary"):
        genspec.build_drafter("edit", tiny_target, edit_source=[1, 1_000_000])


def test_a_per_request_option_is_checked_by_its_declaration_when_the_request_is_added(tiny_target):
    engine = SpeculativeEngine(tiny_target, genspec.build_drafter("edit", tiny_target))
    with pytest.raises(ConfigError, match="drafter 'edit' per-request option source=3.5: expected text or a list"):
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=2, drafter_options={"source": 3.5}))
    with pytest.raises(ConfigError, match="does not take per-request option bogus; it takes: source"):
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=2, drafter_options={"bogus": 1}))


def test_server_settings_refuse_a_bad_drafter_before_a_replica_starts():
    with pytest.raises(ConfigError, match="drafter 'suffix' option max_nodes='x'"):
        ServerSettings(extra_drafters={"suffix": {"max_nodes": "x"}})
    with pytest.raises(ConfigError, match="drafter 'prompt-lookup' option max_ngram=0"):
        ServerSettings(drafter_options={"max_ngram": 0})


# ------------------------------------------------------------------------ the commands refuse before loading
@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a model (or converting the embedded one) fails the test: a refusal must come first."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    for owner, attribute in ((genspec, "load_model"), (genspec.api, "load_model"),
                             (genspec.api, "default_model_dir"), (HFCausalLM, "from_pretrained")):
        monkeypatch.setattr(owner, attribute, loaded)


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "hi", "-O", "max_ngram=x"], "option max_ngram='x': expected an integer"),
    (["generate", "--prompt", "hi", "-O", "max_scan=-1"], "option max_scan=-1"),
    (["generate", "--prompt", "hi", "-O", "bogus=1"], "does not take option bogus"),
    (["generate", "--prompt", "hi", "--drafter", "lookahead", "-O", "window=100000000"], "option window=100000000"),
    (["generate", "--prompt", "hi", "--drafter", "suffix", "-O", "min_prob=x"], "option min_prob='x'"),
    (["generate", "--prompt", "hi", "--drafter", "hybrid", "-O", "lookup=prompt-lookup", "-O", "min_ngram=x"],
     "option min_ngram='x'"),
    (["bench", "--methods", "prompt-lookup:max_ngram=x"], "option max_ngram='x'"),
    (["bench", "--methods", "ngram-cache:min_ratio=x"], "option min_ratio='x'"),
    (["serve", "--extra-drafter", "suffix:factor=x"], "option factor='x'"),
    (["serve", "--extra-drafter", "edit:max_ngram=x"], "option max_ngram='x'"),
    (["serve", "-O", "max_ngram=x"], "option max_ngram='x'"),
    (["demo", "--drafter", "retrieval"], "needs a datastore"),
])
def test_each_command_refuses_in_one_line_before_anything_loads(capsys, nothing_loads, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("extra, message", [
    (["draft", "--vocab-size", "10000000"], "--vocab-size must be from 1 to 1048576, got 10000000"),
    (["draft", "--width", "7"], "--width of a transformer draft must be a multiple of 8"),
    (["draft", "--width", "1000000"], "--width must be from 1 to 8192"),
    (["draft", "--layers", "1000"], "--layers must be from 1 to 64"),
    (["head", "--batch-size", "100000"], "--batch-size must be from 1 to 1024"),
    (["head", "--prompts", "100000"], "--prompts must be from 1 to"),
    (["head", "--max-new-tokens", "10000000"], "--max-new-tokens must be from 1 to"),
    (["head", "--token-layers", "2"], "--token-layers must be from 0 to 1 (the target has 2 layers)"),
    (["head", "--feature-layers", "1,5"], "--feature-layers must be distinct layers in 1..1"),
    (["medusa", "--num-heads", "1000"], "--num-heads must be from 1 to 64"),
    (["medusa", "--seed", "-1"], "--seed must be from 0 to"),
])
def test_train_checks_its_numbers_before_the_target_loads(capsys, tmp_path, tiny_model_dir, monkeypatch, extra,
                                                          message):
    def loaded(*args, **kwargs):
        raise AssertionError("the target was loaded before the arguments were checked")

    monkeypatch.setattr(genspec, "load_model", loaded)
    kind, *rest = extra
    argv = ["train", kind, "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"), *rest]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_train_settings_are_checked_when_made():
    for bad in ({"steps": 0}, {"learning_rate": 0.0}, {"noise": -0.1}, {"batch_size": 2.5},
                {"own_drafted_features": 1}, {"warmup": float("nan")}):
        with pytest.raises(ConfigError, match="training setting"):
            TrainSettings(**bad)


def test_the_manual_lists_every_option_as_declared():
    page = (REPO / "docs" / "drafters" / "options.md").read_text(encoding="utf-8")
    assert options_table() in page, "docs/drafters/options.md: paste genspec.drafters.registry.options_table()"
