"""A draft model with another tokenizer than the target's (Hugging Face's "universal assisted generation").

The draft model keeps its own KV cache, one row per request, in its own tokens: before drafting, the
target's committed tokens are decoded to text and the text encoded with the draft's tokenizer, and the row
is synced with that reading as a same-tokenizer draft model syncs (:func:`~genspec.drafters.draft_model.sync_rows`:
the longest common prefix is kept; re-encoding a text that only grew changes at most its last tokens).

- **Greedy rows** draft freely in the draft's vocabulary; the drafted tokens are decoded to text (in the
  context of the draft's last tokens, so a word's leading space survives) and the text encoded with the
  target's tokenizer after the text of the target's last committed tokens, whose tokens are then found again
  at the front of that encoding and cut off (alignment), so the proposal continues the committed tokens.
  Greedy verification is token match, so the output is plain greedy decoding's whatever the draft proposes.
- **Sampled rows** draft through the shared vocabulary (:class:`SharedVocabulary`: the tokens of both
  tokenizers that stand for the same text): the draft's logits restricted to those tokens and mapped to the
  target's ids are processed with the request's settings, the draft token is drawn from that law and handed
  to the verifier with it. It is a law over the target's vocabulary that the token was drawn from, so the
  standard rule (with its residual, which puts back what the draft cannot propose) keeps the output exactly
  the target's law, and the coupled rule's seeded draws stay coupled.

Differences to Hugging Face's ``AssistedCandidateGeneratorDifferentTokenizers`` /
``UniversalSpeculativeDecodingGenerator``: batched rows that join and leave; the reading re-encoded whole
(as llama.cpp re-tokenizes for a draft of another vocabulary: a batched decode and encode of the committed
text per draft, next to a draft model's forward) rather than through a window; a greedy proposal cut where
the target's tokens of the committed text are found again, by their text when they are not found as tokens
(a prompt's special tokens, a tokenization the target would not have chosen); and shared tokens matched by
the text they decode to, not by their spelling (``▁the`` and ``Ġthe`` both read as a space and "the").
"""
from __future__ import annotations

import re

import torch

from genspec.drafters.base import (Draft, Drafter, DrafterCapabilities, DraftRequest, Option, RequestContext,
                                   draw_tokens)
from genspec.drafters.draft_model import DRAFT_MODEL, sync_rows
from genspec.drafters.ngrams import common_prefix_length
from genspec.errors import ConfigError
from genspec.models.base import CausalLM
from genspec.models.hf import HFCausalLM
from genspec.sampling import TokenHistory, apply_repetition_penalty, process_logits, seen_mask

#: the least share of the smaller vocabulary the two tokenizers must have in common (``min_shared``). A
#: sampled draft can only propose shared tokens: the target's probability on the others is never a draft's
#: to win, and the draft's own probability on its others is cut away before it draws. Tokenizers that share
#: less than half are likely to split text into different units (another script, another
#: normalisation), and their sampled drafts would mostly be rejected at a draft model's cost. It is a guard
#: against a mismatched pair, not a measured optimum: ``-O min_shared=0`` lifts it (greedy drafts, re-encoded
#: as text, do not use the shared tokens).
MIN_SHARED = 0.5
MIN_SHARED_OPTION = Option("min_shared", float, 0.0, 1.0)

#: target tokens of the committed text re-encoded with a greedy proposal, to find where the proposal begins
TARGET_LOOKBEHIND = 8
#: draft tokens before a greedy proposal decoded with it, so its text starts as it does in context
DRAFT_LOOKBEHIND = 4

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte fallback: a byte, not a text


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def token_texts(tokenizer, size: int) -> dict[int, str]:
    """The text each ordinary token of ``tokenizer`` (ids below ``size``) stands for, as it reads after
    another token (decoded after an anchor, the token for "a", whose text is then cut off: decoders drop a
    sequence's leading space, not a later token's). Left out: special tokens, byte-fallback tokens and tokens
    that are not whole characters alone (their text holds U+FFFD)."""
    special = set(tokenizer.all_special_ids)
    ids = sorted(i for i in tokenizer.get_vocab().values() if i < size and i not in special)
    anchor_ids = [i for i in _encode(tokenizer, "a") if i not in special]
    anchor = anchor_ids[-1] if anchor_ids else ids[0]
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's: one call decodes them all
    sequences = [[anchor]] + [[anchor, i] for i in ids]
    prefix, *texts = (backend.decode_batch(sequences, skip_special_tokens=False) if backend is not None
                      else tokenizer.batch_decode(sequences, clean_up_tokenization_spaces=False))
    spelled = tokenizer.convert_ids_to_tokens(ids)
    out = {}
    for i, text, token in zip(ids, texts, spelled):
        if text.startswith(prefix) and len(text) > len(prefix) and "\ufffd" not in text \
                and not _BYTE_TOKEN.fullmatch(str(token)):
            out[i] = text[len(prefix):]
    return out


class SharedVocabulary:
    """The tokens of a draft and a target tokenizer that stand for the same text (:func:`token_texts`; where a
    text has several tokens on one side, its lowest id), as aligned id tensors, and the maps between them.

    ``share``: the shared tokens over the smaller of the two vocabularies (their ordinary tokens)."""

    def __init__(self, draft_tokenizer, target_tokenizer, draft_size: int, target_size: int):
        draft_texts = token_texts(draft_tokenizer, draft_size)
        target_texts = token_texts(target_tokenizer, target_size)
        target_of_text: dict[str, int] = {}
        for i, text in sorted(target_texts.items()):
            target_of_text.setdefault(text, i)
        pairs: dict[str, tuple[int, int]] = {}
        for i, text in sorted(draft_texts.items()):
            if text in target_of_text:
                pairs.setdefault(text, (i, target_of_text[text]))
        draft_ids = [d for d, _ in pairs.values()]
        target_ids = [t for _, t in pairs.values()]
        self.draft_ids = torch.tensor(draft_ids, dtype=torch.long)
        self.target_ids = torch.tensor(target_ids, dtype=torch.long)
        self.target_size = target_size
        self.to_draft = torch.full((target_size,), -1, dtype=torch.long)
        self.to_draft[self.target_ids] = self.draft_ids
        self.size = len(pairs)
        self.share = self.size / max(1, min(len(draft_texts), len(target_texts)))

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """``[R, V_draft]`` draft logits as ``[R, V_target]`` target logits: the shared tokens' at their target
        ids, -inf elsewhere (a law processed from them is the draft's restricted to the shared tokens)."""
        out = torch.full((draft_logits.shape[0], self.target_size), float("-inf"), dtype=draft_logits.dtype,
                         device=draft_logits.device)
        out[:, self.target_ids.to(out.device)] = draft_logits[:, self.draft_ids.to(draft_logits.device)]
        return out


def draft_text(tokenizer, context: list[int], drafted: list[int]) -> str:
    """The text ``drafted`` adds after ``context`` (both the draft's tokens): decoded after the context's last
    :data:`DRAFT_LOOKBEHIND` tokens, whose own text is then cut off."""
    window = context[-DRAFT_LOOKBEHIND:]
    before, after = _decode(tokenizer, window), _decode(tokenizer, window + drafted)
    return after[len(before):] if after.startswith(before) else _decode(tokenizer, drafted)


def continuation_ids(tokenizer, committed: list[int], text: str) -> list[int]:
    """Target tokens for ``text`` after the target's ``committed`` tokens: the text of the last
    :data:`TARGET_LOOKBEHIND` committed tokens and ``text`` encoded together, and the committed tokens' part
    cut off: found as those tokens, else as the longest prefix whose text is theirs (their tokenization may
    not be the tokenizer's own, and special tokens have no text); where the encoding merges the end of their
    text and the start of ``text`` into one token, ``text`` encoded alone."""
    tail = committed[-TARGET_LOOKBEHIND:]
    tail_text = _decode(tokenizer, tail)
    ids = _encode(tokenizer, tail_text + text)
    if ids[:len(tail)] == tail:
        return ids[len(tail):]
    prefixes = tokenizer.batch_decode([ids[:j] for j in range(len(ids) + 1)], skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)
    ends = [j for j, prefix in enumerate(prefixes) if prefix == tail_text]
    return ids[max(ends):] if ends else _encode(tokenizer, text)


def same_vocabulary(tokenizer, other) -> bool:
    """Whether two tokenizers have the same tokens at the same ids."""
    return tokenizer.get_vocab() == other.get_vocab()


def same_tokenizer(target: CausalLM, draft: CausalLM) -> bool:
    """Whether ``draft`` reads and writes the target's token ids: the same vocabulary size and, where both
    have a tokenizer, :func:`same_vocabulary` (a model without a tokenizer is taken at its size)."""
    if draft.vocab_size != target.vocab_size:
        return False
    if target.tokenizer is None or draft.tokenizer is None:
        return True
    return same_vocabulary(target.tokenizer, draft.tokenizer)


class CrossTokenizerDrafter(Drafter):
    """Drafts with ``model``, whose tokenizer is not the target's (``target_tokenizer``, ``target_size`` the
    target's vocabulary size, its logits' width). ``min_shared``: refuse a pair whose shared tokens are fewer
    than this share of the smaller vocabulary (:data:`MIN_SHARED`). One chain per row."""

    name = "draft-model"
    capabilities = DrafterCapabilities(samples_drafts=True)
    options = (DRAFT_MODEL, MIN_SHARED_OPTION)

    def __init__(self, model: CausalLM, target_tokenizer, target_size: int, min_shared: float = MIN_SHARED):
        MIN_SHARED_OPTION.check(min_shared, f"drafter {self.name!r}")
        if model.tokenizer is None:
            raise ConfigError(f"draft and target vocabularies differ ({model.vocab_size} vs {target_size} tokens) "
                              "and the draft model has no tokenizer to translate text with (its directory holds "
                              "no tokenizer files)")
        if target_tokenizer is None:
            raise ConfigError("the target has no tokenizer, and a draft model with another vocabulary needs it "
                              "to translate text")
        self.model = model
        self.tokenizer = model.tokenizer
        self.target_tokenizer = target_tokenizer
        self.shared = SharedVocabulary(model.tokenizer, target_tokenizer, model.vocab_size, target_size)
        if self.shared.share < min_shared:
            raise ConfigError(f"the draft's and the target's tokenizers share {self.shared.size} tokens, "
                              f"{self.shared.share:.0%} of the smaller vocabulary, under min_shared={min_shared:g}: "
                              "sampled drafts can only propose shared tokens (-O min_shared=0 drafts anyway)")
        # the draft's own ending tokens end a greedy draft: they have no text to re-encode
        self._stops = set(model.tokenizer.all_special_ids) | set(model.eos_token_ids)
        self._order: list[int] = []  # request ids, in the model's row order
        self._held: dict[int, list[int]] = {}  # the draft tokens each row holds in the model's cache
        self._read: dict[int, list[int]] = {}  # the target tokens each row's reading was made of
        self._contexts: dict[int, RequestContext] = {}
        model.reset(0)

    @classmethod
    def for_target(cls, target: CausalLM, draft_model: str | CausalLM | None = None,
                   min_shared: float = MIN_SHARED) -> "CrossTokenizerDrafter":
        """``draft_model``: a local model directory with its tokenizer, or a loaded :class:`CausalLM`."""
        DRAFT_MODEL.check(draft_model, f"drafter {cls.name!r}")
        if not isinstance(draft_model, CausalLM):
            draft_model = HFCausalLM.from_pretrained(draft_model)
        return cls(draft_model, target.tokenizer, target.vocab_size, min_shared)

    # --------------------------------------------------------------- life cycle
    def start(self, contexts: list[RequestContext]) -> None:
        self.model.add_rows([[] for _ in contexts])  # the prompt is read at the first draft
        for context in contexts:
            self._order.append(context.request_id)
            self._held[context.request_id] = []
            self._read[context.request_id] = []
            self._contexts[context.request_id] = context

    def finish(self, request_ids: list[int]) -> None:
        gone = set(request_ids) & set(self._held)
        self.model.remove_rows([row for row, i in enumerate(self._order) if i in gone])
        self._order = [i for i in self._order if i not in gone]
        for request_id in gone:
            del self._held[request_id], self._read[request_id], self._contexts[request_id]

    def catch_up_tokens(self, request_id: int, sequence: list[int]) -> int:
        """The target tokens of ``sequence`` this drafter has not read (all of them before its first draft)."""
        return len(sequence) - common_prefix_length(self._read.get(request_id, []), sequence)

    # --------------------------------------------------------------- helpers
    def readings(self, sequences: list[list[int]]) -> list[list[int]]:
        """The draft's tokens for each of the target's ``sequences``: its text (special tokens left out) encoded
        with the draft's tokenizer, with the draft's own special tokens (a beginning of sequence); empty if the
        draft's tokenizer makes nothing of it. One batched decode and one batched encode."""
        if not sequences:
            return []
        texts = self.target_tokenizer.batch_decode(sequences, skip_special_tokens=True,
                                                   clean_up_tokenization_spaces=False)
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]

    def _choose(self, logits: torch.Tensor, contexts: list[RequestContext], running: list[bool],
                drafts: list[list[int]], targets: list[list[int]]) -> tuple[torch.Tensor, dict]:
        """The next draft token per row ``[R]`` from the draft's logits ``[R, V_draft]``: a greedy row's argmax
        in the draft's vocabulary (after its repetition penalty over ``drafts``, the draft's tokens), a sampled
        row's draw from its law over the target's vocabulary restricted to the shared tokens (positions and
        penalty from ``targets``, its target tokens). Also, per sampled row, its (target token, law)."""
        tokens = logits.argmax(-1)
        penalised = [r for r in range(len(contexts)) if running[r] and contexts[r].sampling.greedy
                     and contexts[r].sampling.repetition_penalty != 1.0]
        if penalised:
            index = torch.tensor(penalised)
            seen = seen_mask([drafts[r] for r in penalised], logits.shape[-1], logits.device)
            tokens[index] = apply_repetition_penalty(logits[index], seen, [contexts[r].sampling.repetition_penalty
                                                                           for r in penalised]).argmax(-1)
        sampled = [r for r in range(len(contexts)) if running[r] and not contexts[r].sampling.greedy]
        drawn = {}
        if sampled:
            rows = [contexts[r] for r in sampled]
            index = torch.tensor(sampled)
            history = TokenHistory.of([targets[r] for r in sampled], [len(c.prompt) for c in rows],
                                      [c.sampling for c in rows], self.shared.target_size, logits.device)
            laws = process_logits(self.shared.target_logits(logits[index]), [c.sampling for c in rows], history)
            chosen = draw_tokens(laws, rows, [len(targets[r]) - len(c.prompt) for r, c in zip(sampled, rows)],
                                 [True] * len(rows))
            tokens[index] = self.shared.to_draft.to(chosen.device)[chosen].to(tokens.device)
            drawn = {r: (int(t), law) for r, t, law in zip(sampled, chosen.tolist(), laws)}
        return tokens, drawn

    # --------------------------------------------------------------- interface
    def propose(self, requests: list[DraftRequest]) -> Draft:
        unknown = [r for r in requests if r.request_id not in self._held]
        if unknown:  # proposed for without start: its sequence is its prompt
            self.start([RequestContext(r.request_id, list(r.sequence)) for r in unknown])
        by_id = {r.request_id: r for r in requests}
        contexts = [self._contexts[i] for i in self._order]
        targets = [list(by_id[i].sequence) if i in by_id else [] for i in self._order]
        read = iter(self.readings([t for i, t in zip(self._order, targets) if i in by_id]))
        readings = [next(read) if i in by_id else [] for i in self._order]
        # a row drafts if its reading holds a token to continue from, and a sampled one if any token is shared
        need = [by_id[i].max_tokens if readings[row] and (c.sampling.greedy or self.shared.size) else 0
                for row, (i, c) in enumerate(zip(self._order, contexts))]
        drafts = [reading if n else self._held[i] for i, reading, n in zip(self._order, readings, need)]
        for i in by_id:
            self._read[i] = list(by_id[i].sequence)
        running = [n > 0 for n in need]
        out: list[list[int]] = [[] for _ in self._order]  # target tokens (sampled rows) or draft tokens (greedy)
        laws: list[list[torch.Tensor]] = [[] for _ in self._order]
        if any(running):
            held, logits = sync_rows(self.model, [self._held[i] for i in self._order], drafts, running)
            self._held.update(zip(self._order, held))
            while True:
                tokens, drawn = self._choose(logits, contexts, running, drafts, targets)
                for r in range(len(out)):
                    if not running[r]:
                        continue
                    token = int(tokens[r])
                    if r in drawn:
                        out[r].append(drawn[r][0])
                        laws[r].append(drawn[r][1])
                        targets[r].append(drawn[r][0])
                    elif token in self._stops:
                        running[r] = False
                        continue
                    else:
                        out[r].append(token)
                    drafts[r].append(token)
                    running[r] = len(out[r]) < need[r]
                if not any(running):
                    break
                valid = torch.tensor(running, device=self.model.device).unsqueeze(1)
                logits = self.model.forward(tokens.unsqueeze(1).to(self.model.device), valid)[:, 0]
                self.model.commit_all(valid)
                for r, request_id in enumerate(self._order):
                    if running[r]:
                        self._held[request_id] = self._held[request_id] + [int(tokens[r])]
        return self._as_draft(requests, out, laws, drafts)

    def _as_draft(self, requests: list[DraftRequest], out: list[list[int]], laws: list[list[torch.Tensor]],
                  drafts: list[list[int]]) -> Draft:
        """The rows of ``requests`` in their order: a sampled row's target tokens with their laws, a greedy
        row's draft tokens as target tokens (:func:`draft_text`, :func:`continuation_ids`), cut to its length,
        with one-hot laws in a batch where some row has laws."""
        row_of = {request_id: row for row, request_id in enumerate(self._order)}
        chains, row_laws = [], []
        for request in requests:
            row = row_of[request.request_id]
            chain, law = out[row], laws[row]
            if chain and not law:  # greedy: the draft's tokens, translated
                context = drafts[row][:len(drafts[row]) - len(chain)]
                text = draft_text(self.tokenizer, context, chain)
                chain = continuation_ids(self.target_tokenizer, list(request.sequence), text)[:request.max_tokens]
                if any(t >= self.shared.target_size for t in chain):  # a tokenizer token beyond the target's head
                    chain = chain[:[t >= self.shared.target_size for t in chain].index(True)]
            chains.append(chain)
            row_laws.append(law)
        draft = Draft.from_chains([[c] for c in chains])
        if not any(row_laws):
            return draft
        like = next(law for row in row_laws for law in row)
        probs = torch.zeros(len(chains), 1, draft.width, self.shared.target_size, dtype=like.dtype, device=like.device)
        for row, (chain, law) in enumerate(zip(chains, row_laws)):
            if law:
                probs[row, 0, :len(law)] = torch.stack(law)
            elif chain:  # a greedy row beside sampled ones: the point masses of its tokens
                probs[row, 0, :len(chain)] = torch.nn.functional.one_hot(
                    torch.tensor(chain, device=like.device), self.shared.target_size).to(like.dtype)
        return Draft(draft.tokens, draft.lengths, probs)
