"""Tiny random-weight transformers models built in code (no network), for exact tests."""
from __future__ import annotations

import torch


def tiny_llama(seed: int = 0, vocab: int = 64, layers: int = 2, hidden: int = 64, dtype=torch.float64,
               context: int = 256, kv_heads: int = 2):
    """4 query heads sharing ``kv_heads`` key/value heads (2: grouped-query attention; 4: multi-head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                         max_position_embeddings=context, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_gemma3(seed: int = 0, vocab: int = 64, layers: int = 3, hidden: int = 64, sliding_window: int = 6,
                dtype=torch.float64):
    """Gemma 3 text model with a small sliding window, so that window masking is exercised."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=16, max_position_embeddings=256, sliding_window=sliding_window,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"][:layers],
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return Gemma3ForCausalLM(config).to(dtype).eval()


def peaked(model, scale: float = 8.0):
    """Sharpen a random model's next-token laws (random init gives near-uniform ones), so that
    draft and target differ clearly and acceptance is far from 1."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model


def exact_joint(model, prompt: list[int], length: int, process) -> torch.Tensor:
    """Exact law of the next ``length`` tokens, ``[V] * length``, under ``process`` (logits -> probs)."""
    vocab = model.config.vocab_size
    joint = torch.ones(())
    prefixes = [[]]
    laws = []
    for _ in range(length):
        ids = torch.tensor([prompt + p for p in prefixes])
        with torch.no_grad():
            probs = process(model(ids).logits[:, -1].double())
        laws.append(probs)
        prefixes = [p + [t] for p in prefixes for t in range(vocab)]
    for depth, probs in enumerate(laws):
        joint = (joint.reshape(-1, 1) * probs.reshape(-1, vocab) if depth else probs[0]).reshape(-1)
    return joint.reshape([vocab] * length)


def byte_tokenizer():
    """A byte-level tokenizer built in code (256 byte tokens + <pad> <bos> <eos>), no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>")


def save_tiny_model(directory, seed: int = 0, layers: int = 2, dtype=torch.float32, context: int = 256):
    """Save a tiny Llama with the byte tokenizer to ``directory`` (loadable with from_pretrained)."""
    tokenizer = byte_tokenizer()
    model = tiny_llama(seed, vocab=len(tokenizer), layers=layers, dtype=dtype, context=context)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def sampled_continuations(target, count: int = 24, length: int = 40, seed: int = 1) -> list[list[int]]:
    """The target's own sampled continuations (temperature 0.8) of ``count`` random 4-token prompts: what
    ``genspec train`` trains on, in small."""
    from genspec.engine import SpeculativeEngine

    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 64, (4,), generator=generator).tolist() for _ in range(count)]
    results = SpeculativeEngine(target).generate_ids(prompts, max_new_tokens=length, temperature=0.8, seed=seed,
                                                     eos_token_ids=())
    return [p + r.token_ids for p, r in zip(prompts, results)]


def draft_one_pair(drafter, row, feature: torch.Tensor, position: int, token: int) -> torch.Tensor:
    """A head drafter's predicted feature ``[H]`` from one drafted pair (``feature``, ``token``) at
    ``position``, after the committed pairs in ``row``'s cache (what its forward's drafted half gives)."""
    with torch.no_grad():
        out, _, _ = drafter._run([row], drafter._drafted(feature.view(1, 1, -1), torch.tensor([[token]])),
                                 torch.tensor([[position]]), [1],
                                 [(drafter._empty, drafter._empty, torch.ones(1, 0, dtype=torch.bool))])
    return out[0, 0]


def early_exit_setup(model, exit_layer: int, prompt: list[int], drafts: list[int]):
    """Two targets over ``model`` (the first the early-exit draft's source) that hold ``prompt`` but its last
    token, and the draft of its first ``exit_layer`` layers over ``prompt + drafts``: ``(reused, fresh, draft)``."""
    from genspec.models import HFCausalLM, variants

    reused, fresh = HFCausalLM(model), HFCausalLM(model)
    draft = variants.early_exit(reused, exit_layer)
    for target in (reused, fresh):
        target.reset(1)
        target.forward(torch.tensor([prompt[:-1]]))
        target.commit_all()
    draft.reset(1)
    draft.forward(torch.tensor([prompt + drafts]))
    draft.commit_all()
    return reused, fresh, draft


#: the words of :func:`word_tokenizer` after ``<unk> <bos> <eos>`` (ids 3..11: a 12-token vocabulary)
TARGET_WORDS = ("the", "cat", "dog", "sat", "on", "mat", "a", "ran", ".")
#: the pieces of :func:`piece_tokenizer` after ``<unk> <s> </s>``: six of the target's words whole (the, cat,
#: sat, on, a, ran), dog and mat in two pieces, words the target lacks, and a "." that is not the target's
#: (which decodes after a space); then the metaspace and single letters
DRAFT_PIECES = ("▁the", "▁cat", "▁sat", "▁on", "▁a", "▁ran", "▁big", "▁red", "▁d", "og", "▁m", "at", ".")


def word_tokenizer(words=TARGET_WORDS):
    """A word-level tokenizer built in code: ``<unk> <bos> <eos>`` then ``words``; text split at whitespace
    and punctuation, tokens decoded joined by spaces (no decoder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2}
    for word in words:
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<bos>",
                                   eos_token="<eos>")


def piece_tokenizer(pieces=DRAFT_PIECES):
    """A SentencePiece-style unigram tokenizer built in code: ``<unk> <s> </s>``, ``pieces`` (preferred),
    then the metaspace and every letter they use, so any lower-case text encodes; ``▁`` marks a space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = sorted(set("".join(pieces + TARGET_WORDS)) - {"▁", "."})
    vocab = ([(s, 0.0) for s in ("<unk>", "<s>", "</s>")] + [(p, -1.0) for p in pieces]
             + [(c, -10.0) for c in ["▁"] + letters])
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def word_target(seed: int = 2, layers: int = 2, dtype=torch.float64):
    """A tiny Llama over :func:`word_tokenizer`'s 12 tokens whose head never favours its special tokens (their
    rows are 0), so its greedy text is words (seed 2, 2 layers: "mat dog cat cat ..." after "the cat sat on"),
    which a draft of another tokenizer can propose."""
    model = tiny_llama(seed, vocab=len(TARGET_WORDS) + 3, layers=layers, dtype=dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight[:3] = 0
    return model


def translated_copy(target_model, draft_tokenizer, target_tokenizer, seed: int = 1, layers: int | None = None):
    """The target's network in the draft tokenizer's ids: a tiny Llama over ``draft_tokenizer``'s vocabulary
    whose layers are ``target_model``'s (its first ``layers``, default all) and whose embedding and head rows of
    a token spelled like a target token (``▁the`` and ``the``) are that token's; the others' embeddings random,
    their head rows 0. Drafts (nearly) the target's law where the text is shared, so acceptance is far from 0."""
    config = target_model.config
    draft = tiny_llama(seed, vocab=len(draft_tokenizer), layers=layers or config.num_hidden_layers,
                       hidden=config.hidden_size, dtype=target_model.dtype, context=config.max_position_embeddings)
    state = {k: v for k, v in target_model.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    draft.load_state_dict(state, strict=False)
    target_vocab = target_tokenizer.get_vocab()
    with torch.no_grad():
        draft.get_output_embeddings().weight.zero_()
        for piece, d in draft_tokenizer.get_vocab().items():
            t = target_vocab.get(piece.removeprefix("▁")) if piece.startswith("▁") else None
            if t is not None:
                draft.get_input_embeddings().weight[d] = target_model.get_input_embeddings().weight[t]
                draft.get_output_embeddings().weight[d] = target_model.get_output_embeddings().weight[t]
    return draft


def save_cross_tokenizer_models(directory, draft_pieces=DRAFT_PIECES, dtype=torch.float32):
    """``(target, draft)`` directories: :func:`word_target` with :func:`word_tokenizer` and its
    :func:`translated_copy` with :func:`piece_tokenizer` (``draft_pieces``)."""
    from pathlib import Path

    target_dir, draft_dir = Path(directory) / "target", Path(directory) / "draft"
    words, pieces = word_tokenizer(), piece_tokenizer(draft_pieces)
    target = word_target(dtype=dtype)
    target.save_pretrained(target_dir)
    words.save_pretrained(target_dir)
    translated_copy(target, pieces, words).save_pretrained(draft_dir)
    pieces.save_pretrained(draft_dir)
    return target_dir, draft_dir
