#!/usr/bin/env bash
# The heap model against `train --memory` (issue 26, item 3): each rank's measured growth in a step next to
# the heap model's prediction that train now prints (core/heap.h; from a profile rank 0 measures before
# training). For each configuration below, one run of
#   pipetrain train --model gpt --data synthetic [shape] --stages 2 ... --memory --progress quiet
# over shm (one process per rank, so each rank's heap is its own), and the summary's per-rank
# "peak heap growth ... against the heap model's P (activations + gradients + transfers), measured/predicted R"
# lines into a table. Memory does not depend on the machine's load, so one run per configuration.
# Writes bench/results/heap_model/{raw/,summary.md}. About 1 minute on 2 cores.
# QUICK=1 (ctest bench_quick_heap_model): a tiny GPT, two configurations, into a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
OUT=$(bench_out bench/results/heap_model)
mkdir -p "$OUT/raw"
need_built "$BUILD/pipetrain"
if ((QUICK)); then
  SHAPE="--layers 1 --d-model 32 --heads 2 --seq-len 16 --vocab 32 --batch-size 8"
  CONFIGS=("--schedule 1f1b" "--schedule gpipe --reference")
else
  SHAPE="--layers 4 --d-model 128 --heads 4 --seq-len 64 --vocab 96 --batch-size 32"
  CONFIGS=("--schedule gpipe" "--schedule 1f1b" "--schedule 1f1b -m 8" "--schedule zb-h1" "--schedule zb-h2"
           "--schedule interleaved --virtual 2" "--schedule zb-v" "--schedule v-half" "--schedule v-min"
           "--schedule 1f1b --reference" "--schedule 1f1b --balance time"
           "--schedule 1f1b --replication 2,1 --stages 2 -m 4")
fi
{
  echo "# The heap model against train --memory"
  echo
  echo "pipetrain train --model gpt --data synthetic $SHAPE --stages 2 --transport shm --steps 3 --memory"
  echo "(and the configuration's flags); $(nproc) cores; $("$BUILD/pipetrain" info 2>/dev/null | grep -m1 LibTorch || true)"
  echo
  echo "| configuration | rank | measured MiB | predicted MiB | activations | gradients | transfers | measured/predicted |"
  echo "|---|---|---|---|---|---|---|---|"
} > "$OUT/summary.md"
i=0
for c in "${CONFIGS[@]}"; do
  i=$((i + 1))
  raw="$OUT/raw/run$i.txt"
  # shellcheck disable=SC2086
  if ! "$BUILD/pipetrain" train --model gpt --data synthetic $SHAPE --stages 2 --transport shm --steps 3 \
       --eval-every 0 --sample 0 --progress quiet --memory $c > "$raw" 2>&1; then
    echo "| $c | FAILED (see raw/run$i.txt) | | | | | | |" >> "$OUT/summary.md"
    continue
  fi
  lines=$(grep -E "against the heap model's" "$raw" || true)
  if [[ -z $lines ]]; then
    echo "| $c | FAILED: no prediction: $(grep -m1 'heap model: no prediction' "$raw" | sed 's/.*no prediction: //') | | | | | | |" \
      >> "$OUT/summary.md"
    continue
  fi
  echo "$lines" | sed -E 's/^\[rank 0\] +//' | while IFS= read -r l; do
    who=$(echo "$l" | sed -E 's/^ *(stage [0-9]+|rank [0-9]+ \([^)]*\)):.*/\1/')
    echo "$l" | sed -E "s/.*peak heap growth in a step ([0-9.]+) MiB against the heap model's ([0-9.]+) \(activations ([0-9.]+) \+ gradients ([0-9.]+) \+ transfers ([0-9.]+)\), measured\/predicted ([0-9.]+).*/| $c | $who | \1 | \2 | \3 | \4 | \5 | \6 |/"
  done >> "$OUT/summary.md"
done
cat "$OUT/summary.md"
quick_done "$OUT" summary.md
