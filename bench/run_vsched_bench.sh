#!/usr/bin/env bash
# Issue 14's benchmark: the schedules on V-shaped and looped placements against 1f1b and zb-h1, side by
# side in one run (results: docs/BENCHMARKS.md, "Issue 14: V-shaped and looped schedules").
#
#   bash bench/run_vsched_bench.sh             # ROUNDS=3 STEPS=6; a few minutes on 2 cores
#   QUICK=1 bash bench/run_vsched_bench.sh     # `make test`: every schedule once at tiny sizes into a
#                                              # temporary folder; fails unless it wrote summary.md
#
# One GPT (6 blocks + embedding + head = 8 pipeline layers, d_model 128, 4 heads, vocab 96, context 64,
# batch 32, m = 8) trained with `pipetrain train --stages 2 --threads 1 --memory` (2 processes over gloo,
# one thread each) under 1f1b and zb-h1 (2 stages) and zb-v, v-half, v-min, dualpipev (a V: 4 stages, 2 per
# rank), interleaved-zb and looped-bfs (--virtual 2: 4 stages), ROUNDS interleaved rounds. Per run: the
# median step time (first 2 steps skipped), the simulator's efficiency on the run's own measured stage
# costs (predicted/measured makespan of the last step), and each rank's peak heap growth in a step.
# The predicted activation memory is `pipetrain simulate` on the same sizes (micro-batches of a rank's
# slice); "MiB per predicted micro-batch" divides the measured growth by it: when the memory model
# holds, that column is about the same for every schedule (it also carries the step's gradients, a
# constant per rank).
# Raw outputs: bench/results/vsched/raw/; summary: bench/results/vsched/summary.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-6}
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
MODEL=(--model gpt --data synthetic --layers 6 --d-model 128 --heads 4 --vocab 96 --seq-len 64 --batch-size 32)
M=8
SCHEDULES=(1f1b zb-h1 zb-v v-half v-min dualpipev interleaved-zb looped-bfs)
if ((QUICK)); then
  ROUNDS=1 STEPS=3
  MODEL=(--model gpt --data synthetic --layers 2 --d-model 16 --heads 2 --vocab 32 --seq-len 8 --batch-size 8)
  M=4
fi
OUT=$(bench_out bench/results/vsched)
need_built "$BUILD/pipetrain"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cp "$BUILD/pipetrain" "$TMP/pipetrain"  # others may rebuild the build folder meanwhile
BIN=$TMP/pipetrain
rm -rf "$OUT/raw"
mkdir -p "$OUT/raw"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "nproc: $(nproc)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null)"
  echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$OUT/raw/machine.txt"

virtual_of() { [[ $1 == interleaved-zb || $1 == looped-bfs ]] && echo 2 || echo 1; }

for round in $(seq 1 "$ROUNDS"); do
  for s in "${SCHEDULES[@]}"; do
    log=$OUT/raw/$s.round$round.txt
    if ! "$BIN" train --stages 2 --schedule "$s" --virtual "$(virtual_of "$s")" -m "$M" --steps "$STEPS" \
         --threads 1 --memory --progress quiet "${MODEL[@]}" >"$log" 2>&1; then
      echo "FAILED: $s round $round (see $log)" | tee -a "$log"
    fi
  done
done
for s in "${SCHEDULES[@]}"; do
  "$BIN" simulate --schedule "$s" --stages 2 -m "$M" --virtual "$(virtual_of "$s")" --json >"$OUT/raw/$s.predicted.json"
done

/usr/bin/python3 - "$OUT" "$ROUNDS" "${SCHEDULES[@]}" <<'PY'
import json, re, statistics, sys
out, rounds, schedules = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = []
for s in schedules:
    steps, eff, heap = [], [], {0: [], 1: []}
    for k in range(1, rounds + 1):
        text = open(f"{out}/raw/{s}.round{k}.txt").read()
        m = re.search(r"median step ([0-9.]+) ms", text)
        if m: steps.append(float(m[1]))
        m = re.search(r"efficiency \(predicted/measured\) ([0-9.]+)", text)
        if m: eff.append(float(m[1]))
        lines = [l for l in text.splitlines() if "peak heap growth" in l]
        for r, l in enumerate(lines[:2]):
            heap[r].append(float(re.search(r"peak heap growth in a step ([0-9.]+) MiB", l)[1]))
    pred = json.load(open(f"{out}/raw/{s}.predicted.json"))
    mem = [st["peak_memory"] for st in pred["per_stage"]]
    med = lambda v: statistics.median(v) if v else float("nan")
    rows.append((s, med(steps), min(steps, default=float("nan")), max(steps, default=float("nan")), med(eff),
                 [med(heap[0]), med(heap[1])], mem, pred["bubble_fraction"]))
base = rows[0][1]
with open(f"{out}/summary.md", "w") as f:
    f.write("| schedule | median step ms [min..max] | vs 1f1b | efficiency (predicted/measured) | "
            "predicted bubble fraction | peak heap growth MiB rank 0 / 1 | predicted activation memory "
            "(micro-batches) rank 0 / 1 | MiB per predicted micro-batch rank 0 / 1 |\n")
    f.write("|---|---|---|---|---|---|---|---|\n")
    for s, st, lo, hi, e, h, mem, bub in rows:
        per = [h[r] / mem[r] if mem[r] > 0 else float("nan") for r in range(2)]
        f.write(f"| {s} | {st:.1f} [{lo:.1f}..{hi:.1f}] | {base / st:.2f}x | {e:.2f} | {bub:.3f} | "
                f"{h[0]:.1f} / {h[1]:.1f} | {mem[0]:.2f} / {mem[1]:.2f} | {per[0]:.1f} / {per[1]:.1f} |\n")
print(open(f"{out}/summary.md").read())
PY
quick_done "$OUT" summary.md
