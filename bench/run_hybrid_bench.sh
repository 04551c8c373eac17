#!/usr/bin/env bash
# Pipeline against data parallelism on this machine's 2 cores (issue 6's hybrid runtime): the GPT of the
# runtime benchmark (8 blocks, d_model 256, context 128, synthetic tokens, batch 32, Adam), as
#   pipeline  --stages 2 --schedule 1f1b -m 4        (2 processes, 1 thread each)
#   data      --stages 1 --replicas 2 -m 1           (2 processes, each the whole model on 16 samples)
#   hybrid    --stages 2 --replicas 2 -m 2 --threads 1 (4 processes on 2 cores: oversubscribed, for reference)
# 3 interleaved rounds of 8 steps; the median step of steps 3..8 per run, then the median over rounds.
# Writes bench/results/hybrid/{raw/,summary.md}. About 3 minutes.
# QUICK=1 (`make test`): one round of 3 steps of a tiny GPT into a temporary folder; fails unless it wrote
# summary.md (bench/lib/quick.sh). BUILD (default build) is where pipetrain is.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
OUT=$(bench_out bench/results/hybrid)
mkdir -p "$OUT/raw"
need_built "$BUILD/pipetrain"
BIN=$(mktemp -d)/pipetrain
trap 'rm -rf "$(dirname "$BIN")"' EXIT  # also when a run fails
cp "$BUILD/pipetrain" "$BUILD/pipetrain-torch" "$(dirname "$BIN")/"
COMMON=(--data synthetic --layers 8 --d-model 256 --heads 4 --vocab 96 --seq-len 128 --batch-size 32 --steps 8
        --progress lines --lr 1e-3 --lr-schedule constant --clip 0)
ROUNDS="1 2 3"
if ((QUICK)); then
  COMMON=(--data synthetic --layers 2 --d-model 32 --heads 2 --vocab 96 --seq-len 16 --batch-size 32 --steps 3
          --progress lines --lr 1e-3 --lr-schedule constant --clip 0)
  ROUNDS=1
fi
for round in $ROUNDS; do
  "$BIN" train "${COMMON[@]}" --stages 2 --schedule 1f1b -m 4 >"$OUT/raw/r${round}_pipeline.txt" 2>&1
  "$BIN" train "${COMMON[@]}" --stages 1 --replicas 2 -m 1 >"$OUT/raw/r${round}_data.txt" 2>&1
  "$BIN" train "${COMMON[@]}" --stages 2 --replicas 2 -m 2 --threads 1 >"$OUT/raw/r${round}_hybrid.txt" 2>&1
done
python3 - "$OUT" <<'PY'
import glob, os, re, statistics as st, sys
out = sys.argv[1]
rows = ["| configuration | median step ms (rounds) | samples/s | final loss |", "|---|---|---|---|"]
for name in ("pipeline", "data", "hybrid"):
    meds, losses = [], []
    for f in sorted(glob.glob(os.path.join(out, "raw", f"r*_{name}.txt"))):
        t = open(f).read()
        steps = [float(x) for x in re.findall(r"step +\d+/\d+ .*? ([0-9.]+) ms", t)]
        meds.append(st.median(steps[2:]))
        losses.append(re.search(r"-> ([0-9.]+) over steps", t)[1])
    m = st.median(meds)
    rows.append(f"| {name} | {m:.1f} ({', '.join(f'{x:.0f}' for x in meds)}) | {32000 / m:.1f} | {losses[0]} |")
open(os.path.join(out, "summary.md"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY
quick_done "$OUT" summary.md
