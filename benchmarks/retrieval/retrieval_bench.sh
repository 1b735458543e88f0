#!/usr/bin/env bash
# The manual's retrieval tables (docs/drafters/retrieval.md): model-free drafters with datastores that are
# not the benchmark prompts, then ngram-cache with the held-out answers as a static corpus.
#
#   bash benchmarks/retrieval/retrieval_bench.sh [OUT_DIR [OUT_DIR_NGRAM]]      (about 100 min on a 2-core CPU)
#   (the committed run: OUT_DIR = benchmarks/results/retrieval; default OUT_DIR: bench_results/retrieval)
#
# Datastores (indexes written to $INDEX_ROOT/heldout and $INDEX_ROOT/mixed, default /tmp: the method
# names in the committed results carry these paths):
#   heldout  the embedded model's greedy answers to held-out Spec-Bench prompts (each category's 4th-8th;
#            the bench measures the 1st-2nd), committed as benchmarks/retrieval/datastore/spec_bench_heldout.jsonl
#            (rebuild: python benchmarks/retrieval/build_retrieval_datastore.py --skip 3 --per-category 5 --out FILE)
#   mixed    heldout + the top-level modules of this Python's standard library as one code document
#            (a small stand-in for REST's code datastore)
set -euo pipefail
OUT=${1:-bench_results/retrieval}
OUT_NGRAM=${2:-bench_results/retrieval_ngram_cache}
INDEX_ROOT=${INDEX_ROOT:-/tmp}
ANSWERS=benchmarks/retrieval/datastore/spec_bench_heldout.jsonl
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/mixed" "$OUT" "$OUT_NGRAM"
if [ ! -f "$ANSWERS" ]; then
  python benchmarks/retrieval/build_retrieval_datastore.py --skip 3 --per-category 5 --max-new-tokens 128 --out "$ANSWERS"
fi
cp "$ANSWERS" "$WORK/mixed/"
STDLIB=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
cat "$STDLIB"/*.py > "$WORK/mixed/python_stdlib.txt"
H="$INDEX_ROOT/heldout"
M="$INDEX_ROOT/mixed"
genspec index build "$ANSWERS" --out "$H" --force  # (re)builds its own index
genspec index build "$WORK/mixed" --out "$M" --force
genspec bench --methods "prompt-lookup,retrieval:index=$H,retrieval:index=$M,retrieval:index=$H:context=true,retrieval:index=$M:context=true" \
  --num-prompts 2 --max-new-tokens 128 --repeats 2 --out "$OUT" --force  # rewrites its measured run
genspec bench --methods "ngram-cache,ngram-cache:corpus=$H" \
  --num-prompts 2 --max-new-tokens 128 --repeats 2 --out "$OUT_NGRAM" --force
python benchmarks/analysis/category_table.py "$OUT/results.json" --stats
python benchmarks/analysis/category_table.py "$OUT_NGRAM/results.json" --stats
