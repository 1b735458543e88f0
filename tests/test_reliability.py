"""Promises of reliability (issue 18): no silent wrong output, no traceback on bad input.

Each test states one promise in its docstring; the file reads as the list of them. Tiny models built in
code (tests/tiny_models.py) stand in for the real one; CLI tests run ``genspec.cli.main`` in process.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from tiny_models import byte_tokenizer, peaked, save_tiny_model, tiny_llama

import genspec
from genspec.cli import main
from genspec.drafters import DraftModelDrafter, PromptLookupDrafter
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.errors import ConfigError, NumericalError
from genspec.models import HFCausalLM


def _one_line_error(capsys, argv, message: str) -> str:
    """Run the CLI: exit code 2, one ``genspec: error:`` line on stderr containing ``message``, no traceback."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, (argv, captured)
    lines = [line for line in captured.err.splitlines() if line.startswith("genspec: error:")]
    assert len(lines) == 1 and message in lines[0], captured.err
    assert "Traceback" not in captured.err
    return captured.out


def _settled(engine: SpeculativeEngine) -> bool:
    """Nothing is left running once the cancellations of a failed call are reported (one step)."""
    if engine.has_unfinished():
        engine.step()
    return not engine.has_unfinished()


def _broken(model):
    """``model`` with NaN final-norm weights: every logit is NaN, as the embedded model's in float16."""
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    return model


# ------------------------------------------------------------------ 1. NaN / inf logits, impossible dtypes
def test_nan_logits_fail_the_request_instead_of_emitting_tokens():
    """A run whose target logits are NaN raises NumericalError (greedy and sampled, with and without a
    drafter), never returns made-up tokens."""
    target = HFCausalLM(_broken(tiny_llama(0)))
    for drafter in (None, PromptLookupDrafter()):
        engine = SpeculativeEngine(target, drafter)
        for temperature in (0.0, 0.8):
            with pytest.raises(NumericalError, match="NaN or inf"):
                engine.generate_ids([[5, 6, 7, 5, 6]], max_new_tokens=8, temperature=temperature, seed=1)
            assert _settled(engine)


def test_one_nan_request_fails_alone():
    """Logits are checked per row: a request whose logits are NaN fails (finish reason "error", saying
    why) and its batch neighbours finish normally with the tokens they make alone."""
    healthy, broken = HFCausalLM(tiny_llama(0)), HFCausalLM(tiny_llama(0))
    alone = SpeculativeEngine(healthy).generate_ids([[3, 4, 5]], max_new_tokens=6, eos_token_ids=())[0].token_ids
    engine = SpeculativeEngine(broken)
    good = engine.add_request([3, 4, 5], GenerationConfig(max_new_tokens=6, eos_token_ids=()))
    bad = engine.add_request([9, 9, 9], GenerationConfig(max_new_tokens=6, eos_token_ids=()))
    with torch.no_grad():  # NaN wherever the last input token is 9: only the second request sees it
        broken.model.model.embed_tokens.weight[9] = float("nan")
    tokens, final = {good: [], bad: []}, {}
    while engine.has_unfinished():
        for request_id, step in engine.step().requests.items():
            tokens[request_id] += step.new_tokens
            if step.finish_reason is not None:
                final[request_id] = step
    assert final[bad].finish_reason == "error" and "NaN or inf" in final[bad].error and tokens[bad] == []
    assert final[good].finish_reason == "length" and tokens[good] == alone


def test_nan_draft_law_fails_the_request():
    """A sampling drafter whose law is NaN fails the request (the acceptance rule is lossless only on a
    real law); greedy drafting from it is harmless (the target decides every token) and still runs."""
    target = HFCausalLM(tiny_llama(0))
    engine = SpeculativeEngine(target, DraftModelDrafter(HFCausalLM(_broken(tiny_llama(1, layers=1)))))
    with pytest.raises(NumericalError, match="draft law"):
        engine.generate_ids([[5, 6, 7]], max_new_tokens=8, temperature=0.8, seed=3, draft_length="fixed")
    plain = SpeculativeEngine(target).generate_ids([[5, 6, 7]], max_new_tokens=8, eos_token_ids=())[0].token_ids
    greedy = engine.generate_ids([[5, 6, 7]], max_new_tokens=8, eos_token_ids=(), draft_length="fixed")[0]
    assert greedy.token_ids == plain


def test_nan_logits_are_one_line_in_the_cli(capsys, tmp_path):
    """``genspec generate`` on a model whose logits are NaN: one ``genspec: error:`` line, exit 2, no
    JSON on stdout (the issue's float16 run printed token 0s with exit 0)."""
    directory = save_tiny_model(tmp_path / "broken")
    model = tiny_llama(0, vocab=len(byte_tokenizer()), dtype=torch.float32)
    _broken(model).save_pretrained(directory)
    out = _one_line_error(capsys, ["generate", "--model", str(directory), "--prompt", "abc", "--drafter", "none",
                                   "--max-new-tokens", "4", "--json"], "NaN or inf")
    assert out == ""


def test_embedded_model_in_float16_is_refused_before_loading(monkeypatch, capsys):
    """A dtype the embedded model cannot work in (float16: its activations overflow at the first token)
    is refused with one line naming it, before anything is loaded or converted."""
    import genspec.api

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(genspec.api, "default_model_dir", must_not_load)
    with pytest.raises(ConfigError, match="float16"):
        genspec.load_model(None, dtype="float16")
    _one_line_error(capsys, ["generate", "--prompt", "hi", "--dtype", "float16"], "dtype float16 cannot work")


# ------------------------------------------------------------------ 3. interleaved streams and generate calls
def _byte_engine():
    tokenizer = byte_tokenizer()
    return SpeculativeEngine(HFCausalLM(tiny_llama(0, vocab=len(tokenizer)), tokenizer), PromptLookupDrafter())


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_paused_stream_survives_generate_calls_on_its_engine(temperature):
    """A stream paused while ``generate`` (and another stream) run on the same engine resumes with its own
    text: the same as when it runs alone, and ``generate`` returns what it returns alone."""
    config = GenerationConfig(max_new_tokens=40, temperature=temperature, seed=7, eos_token_ids=())
    short = GenerationConfig(max_new_tokens=6, temperature=temperature, seed=8, eos_token_ids=())
    alone = _byte_engine()
    stream_alone = "".join(alone.stream("abcabcab", config))
    generate_alone = alone.generate("xyzxyz", short)[0].token_ids
    engine = _byte_engine()
    chunks = engine.stream("abcabcab", config)
    text = next(chunks) + next(chunks)
    other = engine.stream("qrsqrs", short)
    next(other)
    assert engine.generate("xyzxyz", short)[0].token_ids == generate_alone
    text += "".join(chunks)
    assert text == stream_alone
    assert "".join(other)  # the other stream ends too
    assert _settled(engine)


def test_generate_is_refused_while_step_api_requests_run(tiny_target):
    """``generate`` steps the whole engine, so while requests added with ``add_request`` run it is refused
    (their steps would be lost to their caller); once they are done it works."""
    engine = SpeculativeEngine(tiny_target)
    request_id = engine.add_request([3, 4, 5], GenerationConfig(max_new_tokens=3))
    with pytest.raises(ConfigError, match="add_request"):
        engine.generate_ids([[6, 7]], max_new_tokens=2)
    seen = []
    while engine.has_unfinished():
        seen += engine.step().requests.get(request_id).new_tokens
    assert len(seen) == 3
    assert len(engine.generate_ids([[6, 7]], max_new_tokens=2, eos_token_ids=())[0].token_ids) == 2


# ------------------------------------------------------------------ 4. stop strings
def test_an_empty_stop_string_is_refused(capsys, tiny_model_dir):
    """An empty stop string (found in any text: the request would stop after one token) is refused in
    the API and the CLI, before the model loads."""
    with pytest.raises(ConfigError, match="stop strings must be non-empty"):
        GenerationConfig(stop_strings=("",))
    with pytest.raises(ConfigError, match="stop strings must be non-empty"):
        GenerationConfig(stop_strings=("END", ""))
    assert GenerationConfig(stop_strings="END").stop_strings == ("END",)  # one string is one stop, not letters
    _one_line_error(capsys, ["generate", "--model", "/nonexistent", "--prompt", "hi", "--stop", ""],
                    "stop strings must be non-empty")


# ------------------------------------------------------------------ 2. seeds under every draft-length policy
#: (policy, k): the draft lengths of a request differ between these (cost follows measured times)
POLICIES = [("fixed", 2), ("fixed", 5), ("heuristic", 4), ("cost", 8)]
SEEDED_PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def sharp_target():
    """A tiny float64 target with sharpened laws (random weights give near-uniform ones, whose draws
    no draft ever matches), so that drafts are accepted under sampling."""
    return HFCausalLM(peaked(tiny_llama(0), 16.0))


def _seeded(policy: str, k: int, drafter: str | None = None) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=40, temperature=0.7, top_p=0.95, seed=11, num_draft_tokens=k,
                            draft_length=policy, drafter=drafter, eos_token_ids=())


def _in_a_batch(engine: SpeculativeEngine, config: GenerationConfig) -> list[int]:
    """The seeded request's tokens when it joins a running batch of requests with other settings, and
    another joins after it."""
    others = [GenerationConfig(max_new_tokens=30, temperature=1.2, eos_token_ids=()),
              GenerationConfig(max_new_tokens=12, eos_token_ids=(), drafter="none"),
              GenerationConfig(max_new_tokens=25, temperature=0.5, top_k=5, seed=3, eos_token_ids=())]
    engine.add_request([20, 21, 20, 21, 20], others[0])
    engine.add_request([10, 11, 12], others[1])
    engine.step()
    engine.step()
    mine = engine.add_request(SEEDED_PROMPT, config)
    tokens = []
    while engine.has_unfinished():
        step = engine.step().requests.get(mine)
        tokens += step.new_tokens if step is not None else []
        if len(tokens) == 1:  # one more joins after it
            engine.add_request([30, 31, 32, 33, 30], others[2])
    return tokens


def _head_tree(target, tree_nodes: int = 6):
    from genspec.drafters.head import HeadDrafter
    from genspec.speculators.head import DraftHead, HeadConfig

    torch.manual_seed(0)
    head = DraftHead(HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128))
    for parameter in head.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return HeadDrafter(target, head.to(torch.float64), list(range(3, 64)), tree_nodes=tree_nodes)


def _medusa_chain(target):
    from genspec.drafters.medusa import MedusaDrafter
    from genspec.speculators.medusa import MedusaConfig, MedusaHeads

    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(64, 3))
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return MedusaDrafter(target, heads.to(torch.float64), list(range(3, 64)))


POINT_MASS_DRAFTERS = {
    "prompt-lookup": lambda target: PromptLookupDrafter(),
    "prompt-lookup-tree": lambda target: PromptLookupDrafter(num_candidates=3),
    "lookahead": lambda target: genspec.build_drafter("lookahead", target, num_candidates=2),
    "ngram-cache": lambda target: genspec.build_drafter("ngram-cache", target, namespace="reliability-test"),
    "head-tree": _head_tree,
}


@pytest.mark.parametrize("name", list(POINT_MASS_DRAFTERS))
def test_seeded_sampling_with_point_mass_drafts_is_the_same_under_every_policy_and_batch(sharp_target, name):
    """With a drafter whose drafts are point masses, a seeded request gives plain sampling's tokens under
    fixed k = 2, fixed k = 5, heuristic and cost draft lengths, alone and joining a batch of requests
    with other settings (the issue's ``--seed`` command, whose default drafter is prompt lookup)."""
    plain = SpeculativeEngine(sharp_target).generate_ids([SEEDED_PROMPT], _seeded("fixed", 1))[0].token_ids
    accepted = 0
    for policy, k in POLICIES:
        drafter = POINT_MASS_DRAFTERS[name](sharp_target)
        assert not drafter.capabilities.samples_drafts
        alone = SpeculativeEngine(sharp_target, drafter).generate_ids([SEEDED_PROMPT], _seeded(policy, k))[0]
        assert alone.token_ids == plain, (policy, k)
        accepted += alone.stats.accepted_tokens
        assert _in_a_batch(SpeculativeEngine(sharp_target, POINT_MASS_DRAFTERS[name](sharp_target)),
                           _seeded(policy, k)) == plain, (policy, k, "batch")
    assert accepted > 0  # speculation took place


SAMPLING_DRAFTERS = {
    "draft-model": lambda target: DraftModelDrafter(HFCausalLM(peaked(tiny_llama(0), 6.0))),  # a blunter target
    "early-exit": lambda target: genspec.build_drafter("early-exit", target, exit_layer=1),
    "early-exit-confident": lambda target: genspec.build_drafter("early-exit", target, exit_layer=1,
                                                                 confidence_threshold=0.3),
    "head-chain": lambda target: _head_tree(target, tree_nodes=0),
    "medusa-chain": _medusa_chain,
}


@pytest.mark.parametrize("name", list(SAMPLING_DRAFTERS))
def test_seeded_sampling_with_sampled_drafts_is_the_same_under_every_policy_and_batch(sharp_target, name):
    """A seeded request whose drafter samples its drafts is verified by the coupled rule (rule "auto"):
    its tokens are plain coupled sampling's (no drafter, the same seed) under fixed k = 2, fixed k = 5,
    heuristic and cost draft lengths, alone and joining a batch of requests with other settings, while
    drafts are both kept and rejected (the issue's ``--seed`` command with a sampling drafter). Under the
    standard rule (``rule="overaccept"``) the draft model's four policies gave four different outputs."""
    plain = SpeculativeEngine(sharp_target).generate_ids([SEEDED_PROMPT], replace(_seeded("fixed", 1), rule="coupled"))[0]
    assert plain.stats.acceptance["rule"] == "coupled"
    accepted = drafted = 0
    for policy, k in POLICIES:
        drafter = SAMPLING_DRAFTERS[name](sharp_target)
        assert drafter.capabilities.samples_drafts
        alone = SpeculativeEngine(sharp_target, drafter).generate_ids([SEEDED_PROMPT], _seeded(policy, k))[0]
        assert alone.stats.acceptance == {"rule": "coupled", "epsilon": 0.0, "delta": None, "residual": None,
                                          "lossless": True}
        assert alone.token_ids == plain.token_ids, (policy, k)
        accepted += alone.stats.accepted_tokens
        drafted += alone.stats.drafted_tokens
        batch = _in_a_batch(SpeculativeEngine(sharp_target, SAMPLING_DRAFTERS[name](sharp_target)), _seeded(policy, k))
        assert batch == plain.token_ids, (policy, k, "batch")
    assert 0 < accepted < drafted  # drafts were kept and rejected (the cost policy may draft nothing)


def test_the_standard_rule_by_name_reproduces_sampled_drafts_under_fixed_and_heuristic(sharp_target):
    """``rule="overaccept"`` keeps the standard rule for a seeded sampling drafter (no coupling: its
    acceptance is 1 - TV): its tokens then depend on where drafts stop, so what holds is reproduction under
    the fixed and heuristic policies, alone or in a batch; and they differ from the coupled rule's."""
    coupled = SpeculativeEngine(sharp_target, SAMPLING_DRAFTERS["draft-model"](sharp_target)).generate_ids(
        [SEEDED_PROMPT], _seeded("fixed", 2))[0].token_ids
    for policy, k in POLICIES[:3]:
        config = replace(_seeded(policy, k), rule="overaccept")
        runs = [SpeculativeEngine(sharp_target, SAMPLING_DRAFTERS["draft-model"](sharp_target)).generate_ids(
            [SEEDED_PROMPT], config)[0] for _ in range(2)]
        assert runs[0].stats.acceptance["rule"] == "overaccept"
        assert runs[0].token_ids == runs[1].token_ids, (policy, k)
        assert runs[0].token_ids != coupled
        batch = _in_a_batch(SpeculativeEngine(sharp_target, SAMPLING_DRAFTERS["draft-model"](sharp_target)), config)
        assert batch == runs[0].token_ids, (policy, k, "batch")


def test_seed_with_a_sampling_drafter_under_cost_warns_only_for_the_standard_rule_by_name(capsys, tiny_model_dirs):
    """``--seed`` with a drafter that samples its drafts under the cost policy is reproducible by default
    (``--rule auto`` couples it): no warning. ``--rule overaccept`` asks for the uncoupled standard rule,
    whose samples then follow measured times: stderr says so and what is reproducible."""
    target, draft = tiny_model_dirs
    base = ["generate", "--model", str(target), "--prompt", "abcabc", "--max-new-tokens", "6", "--seed", "1"]
    sampled = base + ["--temperature", "0.8", "--drafter", "draft-model", "--draft-model", str(draft)]
    for argv, warned in ((sampled, False), (sampled + ["--rule", "overaccept"], True),
                         (sampled + ["--rule", "overaccept", "--draft-length", "fixed"], False),
                         (base + ["--drafter", "draft-model", "--draft-model", str(draft), "--rule", "overaccept"], False)):
        assert main(argv) == 0
        err = capsys.readouterr().err
        assert ("genspec: warning:" in err and "--rule auto" in err) == warned, argv


def test_generate_with_a_seed_and_a_sampling_drafter_prints_the_same_samples_twice(capsys, tiny_model_dirs):
    """The issue's command shape: ``generate --num-samples 4 --temperature 0.8 --seed 1 --json`` with a
    draft model under the default (cost) policy prints the same four samples on two runs, and they differ
    from each other (each sample its own stream)."""
    target, draft = tiny_model_dirs
    argv = ["generate", "--model", str(target), "--prompt", "Once upon a time", "--num-samples", "4",
            "--temperature", "0.8", "--seed", "1", "--max-new-tokens", "24", "--json", "--drafter", "draft-model",
            "--draft-model", str(draft)]
    outputs = []
    for _ in range(2):
        assert main(argv) == 0
        outputs.append([s["token_ids"] for s in json.loads(capsys.readouterr().out)["samples"]])
    assert outputs[0] == outputs[1]
    assert len({tuple(s) for s in outputs[0]}) > 1


# ------------------------------------------------------------------ 5. empty calibration corpus
def test_an_empty_corpus_is_refused_before_the_model_loads(capsys, tmp_path):
    """``calibrate draft-vocab`` with an empty (or blank) corpus file is an error naming the file, before
    the model loads, and writes nothing (it used to write the special tokens as "100% coverage")."""
    from genspec.calibration import draft_vocabulary
    from genspec.errors import InputFileError

    for content in ("", " \n\n"):
        corpus = tmp_path / "empty.txt"
        corpus.write_text(content)
        out = tmp_path / "v.json"
        _one_line_error(capsys, ["calibrate", "draft-vocab", "--model", str(tmp_path / "no-model"), "--corpus",
                                 str(corpus), "--out", str(out)], f"corpus file {corpus} is empty")
        assert not out.exists()
        with pytest.raises(InputFileError, match="is empty"):
            draft_vocabulary(None, 10, [corpus])


def test_draft_vocabulary_counts_the_corpus_text_only(tiny_model_dir, tmp_path):
    """The coverage a draft vocabulary reports is of the corpus's own tokens: the BOS the tokenizer adds
    (always in the vocabulary, as a special token) is not counted as covered text. Corpus "ab", one
    token kept: half the text is covered (counting the BOS said two thirds)."""
    from genspec.calibration import draft_vocabulary

    corpus = tmp_path / "ab.txt"
    corpus.write_text("ab")
    from tokenizers.processors import TemplateProcessing

    target = HFCausalLM.from_pretrained(tiny_model_dir)
    bos = target.tokenizer.bos_token_id  # a tokenizer that adds a BOS, as the embedded model's does
    target.tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A",
                                                                           special_tokens=[("<bos>", bos)])
    assert target.tokenizer("ab")["input_ids"][0] == bos and len(target.tokenizer("ab")["input_ids"]) == 3
    assert draft_vocabulary(target, 1, [corpus])["coverage"] == 0.5


def test_calibration_output_path_is_checked_before_the_model_loads(capsys, tmp_path):
    """``calibrate --out`` that cannot be written (a directory, or under a file) fails at once, before the
    model loads (here: a model path that does not exist would fail later)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text")
    for out, message in ((tmp_path, "is a directory"), (blocker / "v.json", "cannot write")):
        for what in (["draft-vocab", "--corpus", str(corpus)], ["early-exit"], ["layer-skip"]):
            _one_line_error(capsys, ["calibrate", *what, "--model", str(tmp_path / "no-model"), "--out", str(out)],
                            message)
    assert blocker.read_text() == "a file"


# ------------------------------------------------------------------ 10. draft vocabulary ids
def test_draft_vocabulary_ids_outside_the_vocabulary_are_a_clear_error(capsys, tmp_path, tiny_model_dir):
    """``-O draft_vocab_file=FILE`` with an id the model does not have is one error line naming the file and
    the id (it was an IndexError traceback); the API refuses such a subset too."""
    vocab_file = tmp_path / "v.json"
    vocab_file.write_text(json.dumps({"token_ids": [3, 4, 100_000]}))
    _one_line_error(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", "abc", "--drafter", "early-exit",
                             "-O", "exit_layer=1", "-O", f"draft_vocab_file={vocab_file}"], "token id 100000")
    vocab_file.write_text(json.dumps([-1, 3]))
    _one_line_error(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", "abc", "--drafter", "quantized",
                             "-O", f"draft_vocab_file={vocab_file}"], "token id -1")
    with pytest.raises(ConfigError, match="vocabulary subset"):
        HFCausalLM(tiny_llama(0), vocab_subset=[1, 64])


# ------------------------------------------------------------------ 12. a closed pipe
@pytest.mark.parametrize("argv", [["theory", "random-chain", "--vocab", "30", "--horizon", "30", "--out", "-"],
                                  ["generate", "--prompt", "abc", "--max-new-tokens", "200", "--stream",
                                   "--drafter", "none"]])
def test_a_closed_pipe_ends_the_command_quietly(argv, tiny_model_dir):
    """A reader that stops early (``genspec ... | head -c 20``) ends the command quietly, exit code 141
    (128 + SIGPIPE, as a shell reports for Unix tools), with no traceback on stderr."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if argv[0] == "generate":
        argv = argv + ["--model", str(tiny_model_dir)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, "-m", "genspec", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
    assert len(process.stdout.read(20)) == 20
    process.stdout.close()  # the reader goes away
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


# ------------------------------------------------------------------ 14. lesser CLI defects
@pytest.mark.parametrize("extra, message", [
    (["--stream", "--json"], "--stream and --json cannot be combined"),
    (["--stream", "--num-samples", "2"], "--stream prints one sample"),
    (["--num-drafts", "0"], "--num-drafts must be >= 1, got 0"),
    (["--max-new-tokens", "300"], "--max-new-tokens 300 does not fit the model's context of 256"),
    (["--drafter", "edit", "--edit-source", "/nonexistent/source.txt"], "edit source file not found"),
    (["--drafter", "draft-model", "--draft-model", "/nonexistent/draft"], "no draft model at /nonexistent/draft"),
])
def test_generate_refuses_bad_combinations_before_loading(capsys, monkeypatch, tiny_model_dir, extra, message):
    """Combinations the CLI cannot honour are refused with one line naming the options the user gave,
    before the model loads (``genspec.load`` is never called)."""
    import genspec.api

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(genspec.api, "load", must_not_load)
    monkeypatch.setattr(genspec, "load", must_not_load)
    _one_line_error(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", "abc", *extra], message)


def test_a_prompt_and_budget_beyond_the_context_is_refused(capsys, tiny_model_dir):
    """A prompt plus ``--max-new-tokens`` longer than the model's context is refused (as the server
    refuses it) with the most that fits, instead of generating fewer tokens than asked without a word."""
    _one_line_error(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", "a" * 200, "--max-new-tokens",
                             "100"], "the prompt has 200 tokens, so --max-new-tokens 100 does not fit the model's "
                                     "context of 256: at most 56")
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "a" * 200, "--max-new-tokens", "56",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["samples"][0]["token_ids"]) <= 56


# ------------------------------------------------------------------ long runs stopped from outside
def test_long_runs_turn_sigterm_and_an_ignored_sigint_into_an_interrupt_and_restore_the_handlers():
    """``genspec bench`` / ``tradeoff`` save what they measured on ``KeyboardInterrupt``. A background job
    (``cmd &``) inherits SIGINT ignored and ``kill`` sends SIGTERM: a 50-minute tradeoff run stopped either
    way wrote nothing. Within ``stoppable()`` both raise ``KeyboardInterrupt``; afterwards the handlers
    are what they were."""
    import os
    import signal

    from genspec.interrupts import stoppable

    before_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job
    before_term = signal.getsignal(signal.SIGTERM)
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            with pytest.raises(KeyboardInterrupt):
                with stoppable():
                    os.kill(os.getpid(), signum)  # the handler runs at the next bytecode
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == before_term
    finally:
        signal.signal(signal.SIGINT, before_int)
