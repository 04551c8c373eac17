#!/usr/bin/env bash
# Issue 14's benchmark: the schedules on V-shaped and looped placements against 1f1b and zb-h1, side by
# side in one run (results: docs/BENCHMARKS.md, "Issue 14: V-shaped and looped schedules").
#
#   bash bench/run_vsched_bench.sh             # ROUNDS=3 STEPS=6; a few minutes on 2 cores
#   QUICK=1 bash bench/run_vsched_bench.sh     # `make test`: every schedule once at tiny sizes into a
#                                              # temporary folder; fails unless it wrote summary.md
#
# One GPT (6 blocks + embedding + head = 8 pipeline layers, d_model 128, 4 heads, vocab 96, context 64,
# batch 32, m = 8) trained with `pipetrain train --stages 2 --threads 1 --memory` (2 processes over the default transport,
# one thread each) under 1f1b and zb-h1 (2 stages) and zb-v, v-half, v-min, dualpipev (a V: 4 stages, 2 per
# rank), interleaved-zb and looped-bfs (--virtual 2: 4 stages), ROUNDS interleaved rounds. Per run: the
# median step time (first 2 steps skipped), the simulator's efficiency on the run's own measured stage
# costs (predicted/measured makespan of the last step), and each rank's peak heap growth in a step.
# The predicted memory of a rank is what a step adds to its heap, as `pipetrain simulate --profile` predicts
# it (its heap model, docs/ALGORITHMS.md 1.5.1) from a profile of the same model measured in this run at
# the run's micro-batch size, with the run's balance: activations (each layer's saved_bytes), weight
# gradients (from the first backward that makes them until the Step) and the runtime's transfer buffers.
# The row "1f1b --reference" runs 1f1b on the blocking reference path (`train --reference`), predicted
# with `simulate --reference`. The last column divides the measured peak heap growth by the prediction
# (1 = exact).
# Raw outputs: bench/results/vsched/raw/; summary: bench/results/vsched/summary.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-6}
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
MODEL=(--model gpt --data synthetic --layers 6 --d-model 128 --heads 4 --vocab 96 --seq-len 64)
BATCH=32
M=8
# A run is a schedule, or 1f1b-reference: 1f1b on the reference path.
SCHEDULES=(1f1b 1f1b-reference zb-h1 zb-v v-half v-min dualpipev interleaved-zb looped-bfs)
if ((QUICK)); then
  ROUNDS=1 STEPS=3
  MODEL=(--model gpt --data synthetic --layers 2 --d-model 16 --heads 2 --vocab 32 --seq-len 8)
  BATCH=8
  M=4
fi
OUT=$(bench_out bench/results/vsched)
need_built "$BUILD/pipetrain"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cp "$BUILD/pipetrain" "$BUILD/pipetrain-torch" "$TMP/"  # others may rebuild the build folder meanwhile
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
schedule_of() { echo "${1%-reference}"; }
path_of() { [[ $1 == *-reference ]] && echo --reference || true; }

for round in $(seq 1 "$ROUNDS"); do
  for s in "${SCHEDULES[@]}"; do
    log=$OUT/raw/$s.round$round.txt
    # shellcheck disable=SC2046  # path_of prints one flag or nothing
    if ! "$BIN" train --stages 2 --schedule "$(schedule_of "$s")" --virtual "$(virtual_of "$s")" -m "$M" \
         --steps "$STEPS" $(path_of "$s") --threads 1 --memory --progress quiet "${MODEL[@]}" \
         --batch-size "$BATCH" >"$log" 2>&1; then
      echo "FAILED: $s round $round (see $log)" | tee -a "$log"
    fi
  done
done
# The model's profile at the run's micro-batch size (one thread, as the runs), for the memory prediction.
"$BIN" profile "${MODEL[@]}" --microbatch-size "$((BATCH / M))" --threads 1 --repeats 3 \
  --out "$OUT/raw/profile.json" >"$OUT/raw/profile.txt" 2>&1
for s in "${SCHEDULES[@]}"; do
  balance=$(grep -o "balance [0-9,]*[0-9]" "$OUT/raw/$s.round1.txt" | head -1 | cut -d' ' -f2)
  echo "$balance" >"$OUT/raw/$s.balance.txt"
  # shellcheck disable=SC2046
  "$BIN" simulate --schedule "$(schedule_of "$s")" --stages 2 -m "$M" --virtual "$(virtual_of "$s")" $(path_of "$s") \
    --profile "$OUT/raw/profile.json" --balance "$balance" --json >"$OUT/raw/$s.predicted.json"
done
/usr/bin/python3 - "$OUT" "$ROUNDS" "${SCHEDULES[@]}" <<'PY'
import json, re, statistics, sys
out, rounds, schedules = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
MiB = 2**20
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
    # The simulator's heap model: per rank its peak and the parts at that moment.
    pred = [st["heap"] for st in json.load(open(f"{out}/raw/{s}.predicted.json"))["per_stage"]]
    med = lambda v: statistics.median(v) if v else float("nan")
    rows.append((s, med(steps), min(steps, default=float("nan")), max(steps, default=float("nan")), med(eff),
                 [med(heap[0]), med(heap[1])], pred))
base = rows[0][1]
name = lambda s: "1f1b --reference" if s == "1f1b-reference" else s
parts = lambda h: f"{h['activations'] / MiB:.1f} + {h['gradients'] / MiB:.1f} + {h['transfers'] / MiB:.1f}"
with open(f"{out}/summary.md", "w") as f:
    f.write("| schedule | median step ms [min..max] | vs 1f1b | efficiency (predicted/measured) | "
            "peak heap growth MiB rank 0 / 1 | predicted MiB: activations + gradients + transfers, rank 0 / 1 | "
            "measured / predicted rank 0 / 1 |\n")
    f.write("|---|---|---|---|---|---|---|\n")
    for s, st, lo, hi, e, h, pred in rows:
        ratio = [h[r] * MiB / pred[r]["total"] if pred[r]["total"] > 0 else float("nan") for r in range(2)]
        f.write(f"| {name(s)} | {st:.1f} [{lo:.1f}..{hi:.1f}] | {base / st:.2f}x | {e:.2f} | {h[0]:.1f} / {h[1]:.1f} | "
                f"{parts(pred[0])} / {parts(pred[1])} | {ratio[0]:.2f} / {ratio[1]:.2f} |\n")
print(open(f"{out}/summary.md").read())
PY
quick_done "$OUT" summary.md
