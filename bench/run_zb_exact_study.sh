#!/usr/bin/env bash
# Issue 14: zb-auto's greedy schedule against the exact search (core/zb_exact.h) over a grid of small
# (p, m, memory limit, costs); results: docs/BENCHMARKS.md, "Issue 14: zb-auto greedy vs exact".
#
#   bash bench/run_zb_exact_study.sh           # the grid below, NODES=5000000; a few minutes on 2 cores
#   QUICK=1 bash bench/run_zb_exact_study.sh   # `make test`: two tiny cases into a temporary folder; fails
#                                              # unless it wrote summary.md
#
# Each row is one `pipetrain simulate --schedule zb-auto --exact --json` (one step, comm 0): the greedy's
# and the best schedule's makespans, the gap, whether the search proved its schedule optimal within
# NODES search nodes, the bound it proved otherwise, and the nodes it used. Everything but the wall time
# is deterministic (the budget counts nodes); the wall time is one run of the whole command, process start
# (about 0.4 s, mostly LibTorch's libraries loading) included.
# Raw outputs: bench/results/zb_exact/raw/; summary: bench/results/zb_exact/summary.md.
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=${NODES:-5000000}
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
CASES=()  # "p m limit cost"
for cost in 1:1:1 1:2:1; do
  for pm in "2 4" "2 8" "3 4" "3 6" "3 8" "4 4" "4 6" "4 8" "5 5"; do
    read -r p m <<<"$pm"
    for limit in 1.5 2 3 "$p"; do
      CASES+=("$p $m $limit $cost")
    done
  done
done
if ((QUICK)); then
  NODES=1000
  CASES=("2 3 2 1:1:1" "3 4 2 1:2:1")
fi
OUT=$(bench_out bench/results/zb_exact)
need_built "$BUILD/pipetrain"
rm -rf "$OUT/raw"
mkdir -p "$OUT/raw"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "nproc: $(nproc)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null)"
  echo "nodes: $NODES"
} >"$OUT/raw/machine.txt"
{
  echo "| p | m | memory limit | F:B:W | greedy | exact | greedy longer by | proven | bound | nodes | wall s |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|"
} >"$OUT/summary.md"
seen=""
for c in "${CASES[@]}"; do
  read -r p m limit cost <<<"$c"
  key="$p-$m-$limit-$cost"
  [[ " $seen " == *" $key "* ]] && continue  # limit p repeats one of the others for p = 2, 3
  seen="$seen $key"
  raw="$OUT/raw/p${p}_m${m}_l${limit}_${cost//:/-}.json"
  t0=$(date +%s.%N)
  if ! "$BUILD/pipetrain" simulate --schedule zb-auto -p "$p" -m "$m" --memory-limit "$limit" --cost "$cost" \
      --exact --exact-nodes "$NODES" --json >"$raw" 2>"$raw.err"; then
    echo "FAILED: $c" | tee -a "$OUT/summary.md"
    continue
  fi
  t1=$(date +%s.%N)
  python3 - "$raw" "$p" "$m" "$limit" "$cost" "$t0" "$t1" >>"$OUT/summary.md" <<'PY'
import json, sys
path, p, m, limit, cost, t0, t1 = sys.argv[1:]
e = json.load(open(path))["exact"]
print(f"| {p} | {m} | {limit} | {cost} | {e['greedy_makespan']:g} | {e['makespan']:g} | {e['gap_percent']:.2f}% | "
      f"{'yes' if e['proven'] else 'no'} | {e['lower_bound']:g} | {e['nodes']} | {float(t1) - float(t0):.2f} |")
PY
done
cat "$OUT/summary.md"
quick_done "$OUT" summary.md
