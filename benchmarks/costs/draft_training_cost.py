"""What each phase of ``genspec train draft`` costs on the embedded model, in CPU seconds, by the draft's network:
the target's greedy continuations (per generated token), its hidden states (per token recorded) and a training
step (``--batch-size`` sequences of 256 tokens, the default), for the transformer draft and the GRU and LSTM drafts
(``--arch``) of the default width and depth. A few steps each: enough to estimate a full run's time, not a run.

    python benchmarks/costs/draft_training_cost.py --steps 4

CPU seconds of the process (``time.process_time``), not wall time, with ``--threads`` (1) threads: on a machine
others load, a 2-thread kernel waits for whichever thread was descheduled and its wall time means little, while
one thread's CPU time is close to what it would take alone. A quiet 2-core machine runs the 2-thread kernels in
between this and half of it.
"""
from __future__ import annotations

import argparse
import time

import torch

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench
from genspec.speculators.distilled import DraftConfig
from genspec.train.data import choose_vocabulary, collect_sequences, record_features
from genspec.train.loop import train_head
from genspec.train.settings import TrainSettings


def cpu(fn):
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps per network")
    parser.add_argument("--prompts", type=int, default=4, help="prompts continued")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--archs", default="transformer,gru,lstm")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = genspec.load_model(None, backend="torch")
    prompts = [encode_prompt(p.text, target.tokenizer) for p in load_spec_bench(per_category=1)][:args.prompts]
    data, seconds = cpu(lambda: collect_sequences(target, prompts, [], args.max_new_tokens, 384, batch_size=len(prompts)))
    generated = data.info["generated_tokens"]
    print(f"continuations: {generated} tokens, {seconds:.1f} CPU s, {seconds / generated * 1e3:.0f} ms a token")
    # the training pieces are 256 tokens: record that many per sequence (the target's text, then its own continuation)
    long = [(s * (1 + 256 // len(s)))[:257] for s in data.sequences]
    features, seconds = cpu(lambda: record_features(target, long))
    tokens = sum(len(f) for _, f in features)
    print(f"hidden states: {tokens} tokens, {seconds:.1f} CPU s, {seconds / tokens * 1e3:.1f} ms a token")
    vocab = choose_vocabulary(data.sequences, 8192, target.eos_token_ids)
    used = set(vocab)  # a few sequences hold fewer distinct tokens: the rest of the 8,192 rows, for a full head's cost
    vocab += [t for t in range(target.vocab_size) if t not in used][:8192 - len(vocab)]
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size, checkpoint_every=10 ** 9, held_out_every=0)
    import tempfile

    for arch in args.archs.split(","):
        config = DraftConfig(target.config.hidden_size, len(vocab) + 1, max_positions=target.max_context or 8192,
                             arch=arch)
        with tempfile.TemporaryDirectory() as out:
            start = time.process_time()
            steps = []
            train_head(target, features, features[:1], vocab, out, config, settings=settings, kind="draft",
                       progress=lambda step, entry: steps.append(time.process_time()))
            seconds = (steps[-1] - steps[0]) / max(1, len(steps) - 1) if len(steps) > 1 else steps[0] - start
        print(f"{arch}: {seconds:.2f} CPU s a training step ({args.batch_size} x 256 tokens, the first step left out)")


if __name__ == "__main__":
    main()
