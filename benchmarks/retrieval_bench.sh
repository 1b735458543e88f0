#!/usr/bin/env bash
# The README's retrieval tables: model-free drafters with datastores that are not the benchmark prompts.
# (The committed spec_bench_retrieval run also had ngram-cache:corpus=...; those runs were removed, see its
# results.json "note", and re-measured by the second command.)
#
#   bash benchmarks/retrieval_bench.sh [OUT_DIR [OUT_DIR_NGRAM]]      (about 100 min on a 2-core CPU)
#
# Datastores (indexes written to $INDEX_ROOT/heldout and $INDEX_ROOT/mixed, default /tmp: the method
# names in the committed results carry these paths):
#   heldout  the embedded model's greedy answers to held-out Spec-Bench prompts (each category's 4th-8th;
#            the bench measures the 1st-2nd), committed as benchmarks/datastore/spec_bench_heldout.jsonl
#            (rebuild: python benchmarks/build_retrieval_datastore.py --skip 3 --per-category 5 --out FILE)
#   mixed    heldout + the top-level modules of this Python's standard library as one code document
#            (a small stand-in for REST's code datastore)
set -euo pipefail
OUT=${1:-benchmarks/results/spec_bench_retrieval}
OUT_NGRAM=${2:-benchmarks/results/spec_bench_ngram_cache}
INDEX_ROOT=${INDEX_ROOT:-/tmp}
ANSWERS=benchmarks/datastore/spec_bench_heldout.jsonl
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/mixed"
if [ ! -f "$ANSWERS" ]; then
  python benchmarks/build_retrieval_datastore.py --skip 3 --per-category 5 --max-new-tokens 128 --out "$ANSWERS"
fi
cp "$ANSWERS" "$WORK/mixed/"
STDLIB=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
cat "$STDLIB"/*.py > "$WORK/mixed/python_stdlib.txt"
H="$INDEX_ROOT/heldout"
M="$INDEX_ROOT/mixed"
genspec index build "$ANSWERS" --out "$H" --force  # (re)builds its own index
genspec index build "$WORK/mixed" --out "$M" --force
genspec bench --methods "prompt-lookup,retrieval:index=$H,retrieval:index=$M,retrieval:index=$H:context=true,retrieval:index=$M:context=true" \
  --num-prompts 2 --max-new-tokens 128 --repeats 2 --out "$OUT"
genspec bench --methods "ngram-cache,ngram-cache:corpus=$H" \
  --num-prompts 2 --max-new-tokens 128 --repeats 2 --out "$OUT_NGRAM"
python benchmarks/category_table.py "$OUT/results.json" --stats
python benchmarks/category_table.py "$OUT_NGRAM/results.json" --stats
