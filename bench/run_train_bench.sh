#!/usr/bin/env bash
# The main job's figures (issue 4): what `pipetrain train` reaches on real data on this machine.
#   mlp-fmnist  MLP (4 Linear layers, width 256) on Fashion-MNIST, 3 epochs, 2 stages 1f1b, batch 64
#   cnn-fmnist  VGG-16-style CNN (width 8) on Fashion-MNIST, 3 epochs, 2 stages 1f1b, batch 64
#   gpt-kjv     the demo: `pipetrain train` with its defaults (GPT on the King James Bible)
# Each runs once, one after the other (2 processes over gloo, 1 thread each); raw outputs and per-step
# logs go to bench/results/train/, a summary table to bench/results/train/summary.md.
# Usage: bash bench/run_train_bench.sh   (about 5 minutes on 2 cores; builds first if needed)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=bench/results/train
mkdir -p "$OUT"
[[ -x build/pipetrain ]] || make build >/dev/null
BIN=$(mktemp -d)/pipetrain
cp build/pipetrain "$BIN"   # others may rebuild build/ meanwhile

run() {
  local name=$1
  shift
  echo "== $name: $*" >&2
  local t0=$SECONDS
  "$BIN" train "$@" --progress quiet --log "$OUT/$name.jsonl" >"$OUT/$name.txt" 2>&1
  echo "wall_s $((SECONDS - t0))" >>"$OUT/$name.txt"
}
run mlp-fmnist --model mlp --epochs 3 --batch-size 64 --eval-every 938
run cnn-fmnist --model cnn --epochs 3 --batch-size 64 --eval-every 938
run gpt-kjv

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
