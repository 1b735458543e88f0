"""Do genspec's plain decoding on the llamacpp backend and llama-cpp-python's own ``Llama.generate`` write the same
greedy text, and how much of each text repeats itself (what prompt lookup drafts for free)?

    python benchmarks/analysis/plain_text_agreement.py [--categories humanities,reasoning,qa] [--num-prompts 2]

For each prompt ``genspec bench`` measures in those categories: the first token where the two greedy texts
differ (the engines' kernels round the prompt's last position differently: genspec decodes it as its own step,
llama-cpp-python inside the prompt's batch), and for each text the share of its tokens that continue an earlier
3-gram of prompt and text the way it continued there (a text caught in a loop scores near 1), then the first
words after the divergence.
"""
from __future__ import annotations

import argparse

import genspec
from genspec.bench.llamacpp_baselines import LlamaCppDecoder
from genspec.bench.methods import parse_methods
from genspec.bench.prompts import encode_prompt, load_spec_bench
from genspec.sampling import SamplingConfig


def repeated_share(prompt: list[int], text: list[int], n: int = 3) -> float:
    """Share of ``text``'s tokens that follow an (n)-gram seen earlier in prompt + text with that same token."""
    seen: dict[tuple[int, ...], int] = {}
    sequence = list(prompt)
    hits = 0
    for i in range(len(sequence) - n):
        seen[tuple(sequence[i:i + n])] = sequence[i + n]
    for token in text:
        key = tuple(sequence[-n:])
        hits += int(seen.get(key) == token)
        seen[key] = token
        sequence.append(token)
    return hits / max(len(text), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--categories", default="humanities,reasoning,qa")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    engine = genspec.load(drafter="none", backend="llamacpp")
    target, tokenizer = engine.target, engine.tokenizer
    spec = parse_methods("llamacpp-plain", backend="llamacpp")[0]
    prompts = load_spec_bench(args.categories.split(","), args.num_prompts)
    encoded = [encode_prompt(p.text, tokenizer) for p in prompts]
    context = -(-(max(len(ids) for ids in encoded) + args.max_new_tokens + 64) // 256) * 256
    theirs_decoder = LlamaCppDecoder(spec, target.path, list(target.eos_token_ids), context=context)
    print("| prompt | first difference | repeated share, genspec plain | llama-cpp-python plain |")
    print("|---|---|---|---|")
    texts = []
    for prompt, ids in zip(prompts, encoded):
        ours = engine.generate_ids([ids], max_new_tokens=args.max_new_tokens)[0].token_ids
        theirs = theirs_decoder.decode(ids, args.max_new_tokens, SamplingConfig(), seed=0)["token_ids"]
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                     None if len(ours) == len(theirs) else min(len(ours), len(theirs)))
        print(f"| {prompt.category} {prompt.question_id} | {'none' if first is None else f'token {first}'} | "
              f"{repeated_share(ids, ours):.2f} | {repeated_share(ids, theirs):.2f} |")
        if first is not None:
            texts.append((prompt, tokenizer.decode(ours[first:first + 30]), tokenizer.decode(theirs[first:first + 30])))
    for prompt, ours, theirs in texts:
        print(f"\n{prompt.category} {prompt.question_id} after the divergence:\n  genspec: {ours!r}\n  llama  : {theirs!r}")


if __name__ == "__main__":
    main()
