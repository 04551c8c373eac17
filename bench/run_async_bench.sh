#!/usr/bin/env bash
# Issue 5's experiment: asynchronous pipelines against the synchronous 1f1b on Fashion-MNIST.
#   The MLP (4 Linear layers, width 256) on 4 stages, batch 64, the same epochs and learning-rate schedule
#   (cosine, warm-up 5% of the steps, at most 100) for every schedule:
#     1f1b -m 4 (synchronous reference), pipedream (stashing), pipedream --no-stash, pipedream
#     --vertical-sync, 2bw -m 4, spectrain;
#   under two optimizers: SGD with momentum 0.9 (lr 0.02; spectrain is SpecTrain) and Adam (lr 1e-3;
#   spectrain is PipeOptim). Held-out accuracy on all 10,000 test images every 235 steps (1/4 epoch).
#   These runs use --transport local (4 threads, one process): the numbers are deterministic, so the
#   accuracy columns do not depend on the machine's load.
#   Timing: one epoch of 1f1b, 2bw and pipedream (SGD) as 4 processes over gloo, and the same over
#   2 stages (one core per stage on this machine), each run twice; the time per epoch is the sum of the
#   step times (evaluation excluded).
# Raw outputs, per-step logs (TSV: step, loss, lr, grad_norm, step_ms, eval_loss, eval_accuracy),
# summary.md and loss_curves.svg go to bench/results/async/.
# Usage: bash bench/run_async_bench.sh   (about 8 minutes on 2 cores; builds first if needed)
#   EPOCHS=3 (accuracy runs), BUILD=build (where pipetrain is), QUIET_WAIT=60 (s to wait for idle CPUs),
#   SUMMARY_ONLY=1 (only redo summary.md and the SVG from the stored logs)
#   QUICK=1 (`make test`): every schedule and optimizer for 8 steps on synthetic data (which has no
#   held-out split, so no evaluations and no accuracy curves), timing runs of 8 steps on 2 stages, one
#   round each, into a temporary folder;
#   fails unless it wrote summary.md and loss_curves.svg (bench/lib/quick.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
QUIET_WAIT=${QUIET_WAIT:-60}
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
OUT=$(bench_out bench/results/async)
EPOCHS=${EPOCHS:-3}
TIMING_STAGES="4 2" TIMING_ROUNDS="1 2" LENGTH=(--epochs "$EPOCHS") TIMING_LENGTH=(--epochs 1) EVAL=(--eval-every 235)
if ((QUICK)); then
  EPOCHS=1 TIMING_STAGES=2 TIMING_ROUNDS=1 LENGTH=(--steps 8 --data synthetic)
  TIMING_LENGTH=(--steps 8 --data synthetic) EVAL=()
fi
export TIMING_STAGES TIMING_ROUNDS
mkdir -p "$OUT"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT  # also when a run fails
BIN=$TMP/pipetrain
if [[ -z ${SUMMARY_ONLY:-} ]]; then
  need_built "$BUILD/pipetrain"
  cp "$BUILD/pipetrain" "$BUILD/pipetrain-torch" "$(dirname "$BIN")/"  # others may rebuild the build folder meanwhile
fi

# shellcheck source=bench/lib/load.sh
source bench/lib/load.sh  # cpu_busy, wait_quiet, stat_busy, HZ

# run NAME FLAGS...: one `pipetrain train` run; records the CPU load before it and the share of the
# machine other processes used during it (all busy CPU time minus the run's own). With WAIT=1 it first
# waits for idle CPUs (timing runs; the accuracy runs are deterministic).
WAIT=0
run() {
  local name=$1
  shift
  local busy s0 s1 wall usr sys other
  if ((WAIT)); then busy=$(wait_quiet); else busy=$(cpu_busy); fi
  s0=$(stat_busy)
  /usr/bin/time -f '%e %U %S' -o "$TMP/time.txt" "$BIN" train "$@" --progress quiet --log "$OUT/$name.jsonl" \
    >"$OUT/$name.txt" 2>&1 || echo "FAILED: $name (see $OUT/$name.txt)" | tee -a "$OUT/$name.txt"
  s1=$(stat_busy)
  read -r wall usr sys < <(tail -1 "$TMP/time.txt")
  other=$(awk -v d=$((s1 - s0)) -v hz="$HZ" -v w="$wall" -v u="$usr" -v s="$sys" -v n="$(nproc)" \
    'BEGIN { f = (d / hz - (u + s)) / (w * n) * 100; if (f < 0) f = 0; printf "%.0f", f }')
  printf 'command: pipetrain train %s\nwall_s %s\ncpu_busy_before_pct %s\nother_cpu_during_pct %s\n' "$*" "$wall" \
    "$busy" "$other" >>"$OUT/$name.txt"
  printf '  %-28s wall %6s s  (cpu busy before %s%%, others during %s%%)\n' "$name" "$wall" "$busy" "$other"
}

COMMON=(--model mlp --batch-size 64 --clip 0 "${EVAL[@]}")
SCHEDULES=("1f1b:--schedule 1f1b --microbatches 4"
           "pipedream:--schedule pipedream"
           "pipedream-nostash:--schedule pipedream --no-stash"
           "pipedream-vsync:--schedule pipedream --vertical-sync"
           "2bw:--schedule 2bw --microbatches 4"
           "spectrain:--schedule spectrain")
if [[ -z ${SUMMARY_ONLY:-} ]]; then
echo "accuracy runs ($EPOCHS epochs, 4 stages, --transport local):"
for opt in sgd adam; do
  if [[ $opt == sgd ]]; then O=(--optimizer sgd --lr 0.02 --momentum 0.9); else O=(--optimizer adam --lr 1e-3); fi
  for entry in "${SCHEDULES[@]}"; do
    name=${entry%%:*}
    read -r -a flags <<<"${entry#*:}"
    run "$opt-$name" "${COMMON[@]}" --stages 4 "${LENGTH[@]}" --transport local "${O[@]}" "${flags[@]}"
  done
done
echo "timing runs (1 epoch, SGD, gloo processes):"
WAIT=1
for p in $TIMING_STAGES; do
  for round in $TIMING_ROUNDS; do
    for entry in "1f1b:--schedule 1f1b --microbatches 4" "2bw:--schedule 2bw --microbatches 4" "pipedream:--schedule pipedream"; do
      name=${entry%%:*}
      read -r -a flags <<<"${entry#*:}"
      run "time-p$p-$name-r$round" "${COMMON[@]}" --stages "$p" "${TIMING_LENGTH[@]}" --transport gloo --threads 1 \
        --optimizer sgd --lr 0.02 --momentum 0.9 "${flags[@]}"
    done
  done
done
fi

python3 - "$OUT" "$EPOCHS" <<'PY'
import glob, json, os, re, sys
out, epochs = sys.argv[1], int(sys.argv[2])
# The per-step JSON logs become compact TSV files (6 significant digits; the per-stage busy times dropped).
COLS = ["step", "loss", "lr", "grad_norm", "step_ms", "eval_loss", "eval_accuracy"]
for path in glob.glob(os.path.join(out, "*.jsonl")):
    with open(path[:-6] + ".tsv", "w") as tsv:
        tsv.write("\t".join(COLS) + "\n")
        for line in open(path):
            j = json.loads(line)
            tsv.write("\t".join((str(j[c]) if c == "step" else f"{j[c]:.6g}") if c in j else "" for c in COLS) + "\n")
    os.remove(path)
TARGET = 0.85
names = ["1f1b", "pipedream", "pipedream-nostash", "pipedream-vsync", "2bw", "spectrain"]
labels = {"1f1b": "1f1b -m 4 (sync)", "pipedream": "pipedream (stash)", "pipedream-nostash": "pipedream --no-stash",
          "pipedream-vsync": "pipedream --vertical-sync", "2bw": "2bw -m 4", "spectrain": "spectrain"}

def load(name):
    rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(out, name + ".tsv"))]
    steps = [{k: (int(v) if k == "step" else float(v)) for k, v in zip(rows[0], r) if v != ""} for r in rows[1:]]
    text = open(os.path.join(out, name + ".txt")).read()
    return steps, text

def summary(name):
    steps, text = load(name)
    t, evals, to_target = 0.0, [], None
    for s in steps:
        t += s["step_ms"] / 1000
        if "eval_accuracy" in s:
            evals.append((s["step"], s["eval_accuracy"], t))
            if to_target is None and s["eval_accuracy"] >= TARGET:
                to_target = t
    w = re.search(r"extra weight sets kept at most, per stage: (.*)", text)
    policy = re.search(r"weights: ([a-z0-9-]+)", text)
    other = re.search(r"other_cpu_during_pct (\d+)", text)
    return dict(steps=steps, evals=evals, train_s=t, to_target=to_target, final=evals[-1][1] if evals else float("nan"),
                weights=w[1] if w else "-", policy=policy[1] if policy else "-", other=int(other[1]) if other else -1)

rows = []
for opt, title in (("sgd", "SGD, momentum 0.9, lr 0.02"), ("adam", "Adam, lr 1e-3")):
    ref = summary(f"{opt}-1f1b")
    rows.append(f"\n**{title}** ({epochs} epochs, cosine schedule, 4 stages over threads)\n")
    rows.append("| schedule | weights | held-out accuracy per 1/4 epoch | final | vs 1f1b | train s/epoch | "
                f"time to {100*TARGET:.0f}% | extra weight sets per stage (peak) |")
    rows.append("|---|---|---|---|---|---|---|---|")
    for n in names:
        s = summary(f"{opt}-{n}")
        curve = " ".join(f"{100*a:.1f}" for _, a, _ in s["evals"][1:])
        tt = f"{s['to_target']:.1f} s" if s["to_target"] is not None else "not reached"
        rows.append(f"| {labels[n]} | {s['policy']} | {curve} | **{100*s['final']:.2f}%** | "
                    f"{100*(s['final']-ref['final']):+.2f} | {s['train_s']/epochs:.1f} | {tt} | {s['weights']} |")

rounds = [int(r) for r in os.environ.get("TIMING_ROUNDS", "1 2").split()]
stages = [int(p) for p in os.environ.get("TIMING_STAGES", "4 2").split()]
rows.append(f"\n**Time per epoch over gloo processes** (1 epoch, SGD; sum of step times, evaluation excluded; "
            f"{len(rounds)} round(s))\n")
rows.append("| stages | schedule | " + " | ".join(f"round {r} s" for r in rounds) + " | median step ms | "
            f"vs 1f1b (best of {len(rounds)}) | (m+p-1)/m | others' CPU during % |")
rows.append("|---|---|" + "---|" * len(rounds) + "---|---|---|---|")
for p in stages:
    best = {}
    for n in ("1f1b", "2bw", "pipedream"):
        runs = [summary(f"time-p{p}-{n}-r{r}") for r in rounds]
        best[n] = min(r["train_s"] for r in runs)
    for n in ("1f1b", "2bw", "pipedream"):
        runs = [summary(f"time-p{p}-{n}-r{r}") for r in rounds]
        med = sorted(s["step_ms"] for s in runs[0]["steps"])[len(runs[0]["steps"]) // 2]
        ratio = best["1f1b"] / best[n]
        rows.append(f"| {p} | {labels[n]} | " + " | ".join(f"{r['train_s']:.1f}" for r in runs) + f" | {med:.2f} | "
                    f"{ratio:.2f}x | {(4 + p - 1) / 4:.2f} | {', '.join(str(r['other']) for r in runs)} |")
open(os.path.join(out, "summary.md"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))

# One SVG: training loss (moving average over 100 steps) against epochs, one panel per optimizer.
colors = {"1f1b": "#000000", "pipedream": "#1f77b4", "pipedream-nostash": "#d62728", "pipedream-vsync": "#9467bd",
          "2bw": "#2ca02c", "spectrain": "#ff7f0e"}
W, H, PW, PH, L, T = 1000, 470, 440, 320, 60, 40
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<rect width="{W}" height="{H}" fill="white"/>']
ymin, ymax = 0.2, 1.0
for k, (opt, title) in enumerate((("sgd", "SGD momentum 0.9, lr 0.02"), ("adam", "Adam, lr 1e-3"))):
    x0 = L + k * (PW + 60)
    svg.append(f'<text x="{x0 + PW/2}" y="{T - 15}" text-anchor="middle" font-size="14">{title}</text>')
    svg.append(f'<rect x="{x0}" y="{T}" width="{PW}" height="{PH}" fill="none" stroke="#888"/>')
    for e in range(epochs + 1):
        x = x0 + PW * e / epochs
        svg.append(f'<line x1="{x}" y1="{T}" x2="{x}" y2="{T+PH}" stroke="#eee"/>')
        svg.append(f'<text x="{x}" y="{T+PH+16}" text-anchor="middle">{e}</text>')
    for i in range(5):
        v = ymin + (ymax - ymin) * i / 4
        y = T + PH - PH * i / 4
        svg.append(f'<line x1="{x0}" y1="{y}" x2="{x0+PW}" y2="{y}" stroke="#eee"/>')
        svg.append(f'<text x="{x0-6}" y="{y+4}" text-anchor="end">{v:.1f}</text>')
    svg.append(f'<text x="{x0 + PW/2}" y="{T+PH+34}" text-anchor="middle">epoch</text>')
    if k == 0:
        svg.append(f'<text x="14" y="{T + PH/2}" transform="rotate(-90 14 {T + PH/2})" text-anchor="middle">'
                   'training loss (mean of 100 steps)</text>')
    for n in names:
        steps, _ = load(f"{opt}-{n}")
        per_epoch = len(steps) / epochs
        losses = [s["loss"] for s in steps]
        pts = []
        for i in range(99, len(losses), 10):
            v = sum(losses[i - 99:i + 1]) / 100
            x = x0 + PW * (i + 1) / per_epoch / epochs
            y = T + PH - PH * (min(max(v, ymin), ymax) - ymin) / (ymax - ymin)
            pts.append(f"{x:.1f},{y:.1f}")
        svg.append(f'<polyline fill="none" stroke="{colors[n]}" stroke-width="1.3" points="{" ".join(pts)}"/>')
for i, n in enumerate(names):
    x = L + 10 + (i % 3) * 300
    y = H - 44 + (i // 3) * 18
    svg.append(f'<line x1="{x}" y1="{y-4}" x2="{x+24}" y2="{y-4}" stroke="{colors[n]}" stroke-width="2"/>')
    svg.append(f'<text x="{x+30}" y="{y}">{labels[n]}</text>')
svg.append("</svg>")
open(os.path.join(out, "loss_curves.svg"), "w").write("\n".join(svg) + "\n")
print("wrote", os.path.join(out, "summary.md"), "and", os.path.join(out, "loss_curves.svg"))
PY
rm -rf "$TMP"
quick_done "$OUT" summary.md loss_curves.svg
