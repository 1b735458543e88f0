"""Numbered lists in lookup drafts (genspec.drafters.enumeration): the rewrite on text, the tokenizers it
accepts, and the engine: greedy output unchanged, fewer target calls on a list, the option's errors."""
from __future__ import annotations

import pytest
from test_drafters_model_free import CopyModel, propose
from tiny_models import byte_tokenizer

import genspec
from genspec.drafters.enumeration import Enumeration
from genspec.drafters.prompt_lookup import PromptLookupDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def enumeration(tokenizer):
    found = Enumeration.of_tokenizer(tokenizer)
    assert found is not None
    return found


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("sequence, chain, expected", [
    # a count: the copy of "5.\n" continues "6.", the list is at 15
    ("\n1.\n2.\n3.\n4.\n5.\n6.\n7.\n8.\n9.\n10.\n11.\n12.\n13.\n14.\n15.\n", "6.\n7.\n8.\n", "16.\n17.\n18.\n"),
    # the item's text is kept, every later item counts on
    ("\n1. ab\n2. cd\n15. ab", " cd\n6. ab\n7.", " cd\n16. ab\n17."),
    # a number the sequence has begun is finished ("1" of "16"), before the delimiter
    ("\n1. ab\n2. cd\n15. ab\n1", ". cd\n7. ab", "6. cd\n17. ab"),
    # one digit more at 9 -> 10
    ("\n8) x\n9) y\n", "3) z\n4) w", "10) z\n11) w"),
    # another delimiter is another list: left alone
    ("\n1) a\n2) b\n", "3. c\n", "3. c\n"),
    # numbers inside a line, or no earlier item: left alone
    ("\n1. In 2017 the storm", " hit 12 towns\n", " hit 12 towns\n"),
    ("In 2017 the storm\n", "2018 was calm", "2018 was calm"),
    # a number the sequence began that cannot be the next one: left alone
    ("\n1. a\n2. b\n5", ". c", ". c"),
])
def test_renumber(tokenizer, enumeration, sequence, chain, expected):
    got, = enumeration.renumber(_ids(tokenizer, sequence), [_ids(tokenizer, chain)])
    assert tokenizer.decode(got) == expected


def test_last_item_reads_the_last_complete_item(tokenizer, enumeration):
    assert enumeration.last_item(_ids(tokenizer, "x\n3. a\n12. b\n1")) == (12, _ids(tokenizer, ".")[0])
    assert enumeration.last_item(_ids(tokenizer, "no list here, 3. only inline")) is None


def test_only_tokenizers_with_one_token_per_digit(tokenizer):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    vocab["12"] = len(vocab)
    merged = Tokenizer(models.BPE(vocab=vocab, merges=[("1", "2")]))
    merged.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    merged.decoder = decoders.ByteLevel()
    assert Enumeration.of_tokenizer(PreTrainedTokenizerFast(tokenizer_object=merged)) is None
    assert Enumeration.of_tokenizer(None) is None


def _list_document(tokenizer) -> tuple[list[int], list[int]]:
    """A prompt ending in a two-item list and the greedy continuation of a copying target: items 3-40,
    their texts repeating the first two in turn."""
    prompt = _ids(tokenizer, "Colours:\n1. red\n2. blue\n")
    rest = _ids(tokenizer, "".join(f"{n}. {'red' if n % 2 else 'blue'}\n" for n in range(3, 41)))
    return prompt, prompt + rest


def test_greedy_output_is_unchanged_and_a_list_takes_fewer_target_calls(tokenizer):
    prompt, document = _list_document(tokenizer)
    new_tokens = len(document) - len(prompt)
    calls = {}
    for renumber in (False, True):
        target = CopyModel([document], len(tokenizer), tokenizer)
        drafter = PromptLookupDrafter.for_target(target, renumber=renumber)
        assert (drafter.enumeration is not None) == renumber
        result = SpeculativeEngine(target, drafter).generate_ids([prompt], max_new_tokens=new_tokens, eos_token_ids=(),
                                                                 num_draft_tokens=8, draft_length="fixed")[0]
        assert result.token_ids == document[len(prompt):]
        calls[renumber] = result.stats.target_calls
    # without it every item's number is drafted wrong (a copy of an earlier item's); with it only the text
    # of an item may be
    assert calls[True] < 0.6 * calls[False]


def test_a_lookup_chain_is_renumbered_and_cut_to_the_limit(tokenizer):
    prompt, document = _list_document(tokenizer)
    sequence = document[:document.index(_ids(tokenizer, "9")[0])]  # up to the line end before item 9
    drafter = PromptLookupDrafter.for_target(CopyModel([document], len(tokenizer), tokenizer))
    draft = propose(drafter, [sequence], [3])
    assert tokenizer.decode(draft.tokens[0, 0, :int(draft.lengths[0, 0])].tolist()) == "9. "


def test_the_option_and_its_errors(tokenizer, tiny_target):
    with pytest.raises(ConfigError, match="option renumber=.maybe.: expected true or false"):
        genspec.build_drafter("prompt-lookup", tiny_target, renumber="maybe")
    assert genspec.build_drafter("suffix", tiny_target).enumeration is None  # no tokenizer: nothing to read
    target = CopyModel([[0]], len(tokenizer), tokenizer)
    assert genspec.build_drafter("suffix", target).enumeration is not None
    assert genspec.build_drafter("suffix", target, renumber=False).enumeration is None


def test_the_edit_drafter_keeps_its_sources_numbers_unless_asked(tokenizer):
    target = CopyModel([[0]], len(tokenizer), tokenizer)
    assert genspec.build_drafter("edit", target).enumeration is None
    assert genspec.build_drafter("edit", target, renumber=True).enumeration is not None
    assert genspec.build_drafter("lookahead", target).enumeration is not None
