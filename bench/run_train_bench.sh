#!/usr/bin/env bash
# The main job's figures (issue 4): what `pipetrain train` reaches on real data on this machine.
#   mlp-fmnist  MLP (4 Linear layers, width 256) on Fashion-MNIST, 3 epochs, 2 stages 1f1b, batch 64
#   cnn-fmnist  VGG-16-style CNN (width 8) on Fashion-MNIST, 3 epochs, 2 stages 1f1b, batch 64
#   gpt-kjv     the demo: `pipetrain train` with its defaults (GPT on the King James Bible)
# Each runs once, one after the other (2 processes over the default transport, shm on one host, 1 thread each); raw outputs and per-step
# logs go to bench/results/train/, a summary table to bench/results/train/summary.md.
# Usage: bash bench/run_train_bench.sh   (about 5 minutes on 2 cores; builds first if needed)
#        QUICK=1 bash bench/run_train_bench.sh   (`make test`: 4 steps of each, tiny GPT, into a temporary
#        folder; fails unless it wrote summary.md. bench/lib/quick.sh; BUILD=build is where pipetrain is)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
OUT=$(bench_out bench/results/train)
mkdir -p "$OUT"
need_built "$BUILD/pipetrain"
BIN=$(mktemp -d)/pipetrain
trap 'rm -rf "$(dirname "$BIN")"' EXIT  # also when a run fails
cp "$BUILD/pipetrain" "$BUILD/pipetrain-torch" "$(dirname "$BIN")/"   # others may rebuild build/ meanwhile
# Quick: a few steps with an evaluation at step 0 and at the end, and a tiny GPT.
LENGTH=(--epochs 3 --eval-every 938) QUICK_GPT=()
if ((QUICK)); then
  LENGTH=(--steps 4 --eval-every 4 --eval-samples 64)
  QUICK_GPT=(--steps 4 --eval-every 4 --eval-samples 8 --layers 1 --d-model 32 --heads 2 --seq-len 16 --batch-size 8)
fi

run() {
  local name=$1
  shift
  echo "== $name: $*" >&2
  local t0=$SECONDS
  "$BIN" train "$@" --progress quiet --log "$OUT/$name.jsonl" >"$OUT/$name.txt" 2>&1
  echo "wall_s $((SECONDS - t0))" >>"$OUT/$name.txt"
}
run mlp-fmnist --model mlp --batch-size 64 "${LENGTH[@]}"
run cnn-fmnist --model cnn --batch-size 64 "${LENGTH[@]}"
run gpt-kjv "${QUICK_GPT[@]}"

python3 - "$OUT" <<'PY'
import json, re, sys, os
out = sys.argv[1]
rows = ["| run | steps | wall s | median step ms | throughput | held-out at step 0 | held-out at the end |", "|---|---|---|---|---|---|---|"]
for name in ("mlp-fmnist", "cnn-fmnist", "gpt-kjv"):
    t = open(os.path.join(out, name + ".txt")).read()
    s = re.search(r"median step ([0-9.]+) ms, ([0-9.k]+) (\w+)/s", t)
    first = re.search(r"eval at step 0: (.*?) \(", t)
    last = re.search(r"held-out: (.*?)(?: \(at step 0|$)", t, re.M)
    steps = sum(1 for _ in open(os.path.join(out, name + ".jsonl")))
    wall = re.search(r"wall_s (\d+)", t)[1]
    rows.append(f"| {name} | {steps} | {wall} | {s[1]} | {s[2]} {s[3]}/s | {first[1]} | {last[1]} |")
open(os.path.join(out, "summary.md"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY
quick_done "$OUT" summary.md
