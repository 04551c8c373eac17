#!/usr/bin/env bash
# Issue 7's experiment: UMPIPE in the real runtime. For the GPT (heavy embedding and head) and the
# VGG-style CNN: measure a profile at several micro-batch sizes, plan with --planner umpipe (every
# planner's partitions in one plan file, re-materialised as the runtime runs them), then train the
# equal partition (best m) and DGAP's partitions side by side in alternating rounds, and compare
# predicted with measured step times. 8 and 16 stages are planned (predicted) only.
#   gpt   14 blocks (16 pipeline layers, as GPT1-14), d_model 64, 4 heads, context 64, vocabulary 4096
#         (synthetic tokens), so the head (64 x 4096) and the embedding are heavier than a block; batch 32
#   cnn   VGG-16 style (16 layers), width 8, Fashion-MNIST, batch 64
#   runs  2 stages (one process per core, 1 intra-op thread each); 4 stages put two processes on each
#         core (oversubscribed: shown, not to be read as a 4-device result). STEPS steps per run, the
#         median of steps 3..STEPS; ROUNDS rounds, each running equal and dgap back to back, the order
#         alternating; the table gives the median over rounds.
# Environment: ROUNDS (default 3), STEPS (default 12), RUN_STAGES (default "2 4"), BUILD (default build),
# OUT (default bench/results/umpipe), REUSE=1 (keep the profiles and plans already in OUT) and FIRST_ROUND
# (default 1), to add rounds to a run: the summary takes every round found in OUT/raw. The machine is shared: each run waits for the CPUs to be quiet
# (bench/lib/load.sh) and the load is recorded. About 10 minutes on 2 cores.
# QUICK=1 (`make test`): a tiny GPT only (4 blocks, d_model 32, vocabulary 256, batch 16), profiled at 3
# sizes once, planned for 2 stages, one round of 3 steps of equal and dgap, into a temporary folder;
# fails unless it wrote summary.md and results.json (bench/lib/quick.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib/load.sh
. bench/lib/load.sh
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
OUT=$(bench_out bench/results/umpipe)
ROUNDS=${ROUNDS:-3}
FIRST_ROUND=${FIRST_ROUND:-1}
STEPS=${STEPS:-12}
RUN_STAGES=${RUN_STAGES:-"2 4"}
MODELS="gpt cnn" PLAN_STAGES="2 4 8 16" REPEATS=7
mkdir -p "$OUT/raw"
need_built "$BUILD/pipetrain"
BIN=$(mktemp -d)/pipetrain
trap 'rm -rf "$(dirname "$BIN")"' EXIT  # also when a run fails
cp "$BUILD/pipetrain" "$BUILD/pipetrain-torch" "$(dirname "$BIN")/"
declare -A FLAGS BATCH MICRO SIZES EVAL
FLAGS[gpt]="--model gpt --data synthetic --layers 14 --d-model 64 --heads 4 --seq-len 64 --vocab 4096"
BATCH[gpt]=32
MICRO[gpt]=8
SIZES[gpt]="1 2 4 8 16 32"
FLAGS[cnn]="--model cnn --data fashion-mnist"
EVAL[cnn]="--eval-samples 32"  # evaluated at the end; the gpt's synthetic data has no held-out split
BATCH[cnn]=64
MICRO[cnn]=16
SIZES[cnn]="1 2 4 8 16 32 64"
if ((QUICK)); then
  MODELS=gpt PLAN_STAGES=2 RUN_STAGES=2 ROUNDS=1 FIRST_ROUND=1 STEPS=3 REPEATS=1
  FLAGS[gpt]="--model gpt --data synthetic --layers 4 --d-model 32 --heads 2 --seq-len 16 --vocab 256"
  BATCH[gpt]=16
  MICRO[gpt]=4
  SIZES[gpt]="1 4 16"
fi
export MODELS PLAN_STAGES
{
  echo "== run: ROUNDS=$ROUNDS STEPS=$STEPS RUN_STAGES=$RUN_STAGES REUSE=${REUSE:-0}"
  echo "date: $(date -u +%FT%TZ)"
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  "$BIN" info
} >>"$OUT/raw/machine.txt" 2>&1

for model in $MODELS; do
  if [[ ${REUSE:-0} == 1 && -f $OUT/$model-p2-plan.json ]]; then
    echo "== $model: reusing $OUT/$model-profile.json and its plans" >&2
  else
  echo "== $model: profile (CPU busy before: $(wait_quiet)%)" >&2
  # shellcheck disable=SC2086
  "$BIN" profile ${FLAGS[$model]} --microbatch-size "${MICRO[$model]}" --threads 1 --repeats $REPEATS --sizes ${SIZES[$model]} \
    --out "$OUT/$model-profile.json" >"$OUT/raw/$model-profile.txt"
  for p in $PLAN_STAGES; do
    echo "== $model: plan for $p stages" >&2
    "$BIN" plan --profile "$OUT/$model-profile.json" --ranks "$p" --batch-size "${BATCH[$model]}" --planner umpipe \
      --latency 60 --out "$OUT/$model-p$p-plan.json" >"$OUT/raw/$model-p$p-plan.txt" 2>&1 ||
      echo "FAILED" >>"$OUT/raw/$model-p$p-plan.txt"
  done
  fi
  for p in $RUN_STAGES; do
    for round in $(seq "$FIRST_ROUND" $((FIRST_ROUND + ROUNDS - 1))); do
      if ((round % 2)); then order="equal dgap"; else order="dgap equal"; fi
      for mode in $order; do
        name="$model-p$p-$mode-r$round"
        busy=$(wait_quiet)
        echo "== $name (CPU busy before: $busy%)" >&2
        echo "cpu busy before: $busy%" >"$OUT/raw/$name.txt"
        # shellcheck disable=SC2086
        "$BIN" train --plan "$OUT/$model-p$p-plan.json" --umpipe "$mode" ${FLAGS[$model]} \
          --batch-size "${BATCH[$model]}" --steps "$STEPS" --lr-schedule constant \
          ${EVAL[$model]:+--eval-every $STEPS ${EVAL[$model]}} --sample 0 --progress lines --log "$OUT/raw/$name.jsonl" >>"$OUT/raw/$name.txt" 2>&1 ||
          echo "FAILED" >>"$OUT/raw/$name.txt"
      done
    done
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/raw/machine.txt"

python3 - "$OUT" "$RUN_STAGES" <<'PY'
import glob, json, os, re, statistics as st, sys
out = sys.argv[1]
run_stages = tuple(int(x) for x in sys.argv[2].split())
models = os.environ.get("MODELS", "gpt cnn").split()
plan_stages = [int(x) for x in os.environ.get("PLAN_STAGES", "2 4 8 16").split()]
planners = ("equal", "local-greedy", "global-dp", "dgap")
res = {"planned": {}, "measured": {}}
md = []
f = lambda x, fmt="{:.1f}": "-" if x is None else fmt.format(x)
pct = lambda a, b: None if a is None or b is None or b <= 0 else 100.0 * (a / b - 1.0)

md += ["Predicted ms per mini-batch (GPipe order, re-materialised), gain = equal / DGAP - 1:", "",
       "| model | stages | balance | equal (m) | local greedy | global DP | DGAP | predicted gain |",
       "|---|---|---|---|---|---|---|---|"]
for model in models:
    for p in plan_stages:
        path = os.path.join(out, f"{model}-p{p}-plan.json")
        if not os.path.exists(path):
            continue
        try:
            u = json.load(open(path))["umpipe"]
        except Exception:
            continue
        t = {k: u["planners"][k]["step_ms"] for k in planners}
        res["planned"][f"{model}-p{p}"] = dict(balance=u["balance"], step_ms=t, m=u["planners"]["equal"].get("microbatches"),
                                               dgap=dict(forward=u["forward"], backward=u["backward"]))
        md.append(f"| {model} | {p} | {','.join(map(str, u['balance']))} | {t['equal']:.1f} (m={u['planners']['equal'].get('microbatches')}) | "
                  f"{t['local-greedy']:.1f} | {t['global-dp']:.1f} | {t['dgap']:.1f} | {pct(t['equal'], t['dgap']):+.1f}% |")

md += ["", "Measured (median of steps 3.., per run; median over the rounds, per-round medians in brackets):", "",
       "| model | stages | plan | predicted ms | measured step ms | measured pass ms | pass: predicted / measured |",
       "|---|---|---|---|---|---|---|"]
gains = []
for model in models:
    for p in run_stages:
        key = f"{model}-p{p}"
        if key not in res["planned"]:
            continue
        row = {}
        for mode in ("equal", "dgap"):
            step, pas = [], []
            logs = glob.glob(os.path.join(out, "raw", f"{key}-{mode}-r*.jsonl"))
            for log in sorted(logs, key=lambda x: int(re.search(r"-r([0-9]+)[.]jsonl$", x)[1])):
                entries = [json.loads(line) for line in open(log) if line.strip()]
                entries = entries[2:] if len(entries) > 3 else entries
                if entries:
                    step.append(st.median(e["step_ms"] for e in entries))
                    pas.append(st.median(e["pass_ms"] for e in entries))
            pred = res["planned"][key]["step_ms"][mode]
            row[mode] = dict(predicted_ms=pred, step_ms=st.median(step) if step else None, rounds_step_ms=step,
                             pass_ms=st.median(pas) if pas else None, rounds_pass_ms=pas)
            m = row[mode]
            label = mode + (f" (m={res['planned'][key]['m']})" if mode == "equal" else "")
            md.append(f"| {model} | {p}{' (2 per core)' if p > 2 else ''} | {label} | {pred:.1f} | {f(m['step_ms'])} "
                      f"({', '.join(f'{x:.1f}' for x in step)}) | {f(m['pass_ms'])} ({', '.join(f'{x:.1f}' for x in pas)}) | "
                      f"{f(pred / m['pass_ms'] if m['pass_ms'] else None, '{:.2f}')} |")
        e, d = row.get("equal", {}), row.get("dgap", {})
        g = dict(model=model, stages=p, predicted=pct(e.get("predicted_ms"), d.get("predicted_ms")),
                 step=pct(e.get("step_ms"), d.get("step_ms")), pass_=pct(e.get("pass_ms"), d.get("pass_ms")))
        gains.append(g)
        res["measured"][key] = dict(row, gain=g)
def layer_points(layer):  # (size, forward ms, backward ms), as the planner's table fit reads them
    pts = {e["micro_batch_size"]: (e["forward_ms"], e["backward_ms"]) for e in layer.get("by_micro_batch", [])}
    return sorted(pts.items())
def at(pts, b, i):  # piecewise linear, continued along the end segments
    xs = [p[0] for p in pts]
    k = 0 if b <= xs[0] else len(xs) - 2 if b >= xs[-1] else max(j for j in range(len(xs) - 1) if xs[j] <= b)
    (x0, y0), (x1, y1) = (xs[k], pts[k][1][i]), (xs[k + 1], pts[k + 1][1][i])
    return y0 + (y1 - y0) * (b - x0) / (x1 - x0)
md += ["", "Per-stage busy ms (compute only), predicted from the profile's points against measured (median):", "",
       "| model | stages | plan | predicted per stage | measured per stage | measured / predicted |", "|---|---|---|---|---|---|"]
for model in models:
    prof = json.load(open(os.path.join(out, f"{model}-profile.json")))
    for p in run_stages:
        key = f"{model}-p{p}"
        if key not in res["measured"]:
            continue
        u = json.load(open(os.path.join(out, f"{key}-plan.json")))["umpipe"]
        for mode in ("equal", "dgap"):
            rows, start, pred = u["planners"][mode], 0, []
            for j, n in enumerate(u["balance"]):
                layers = [layer_points(prof["layers"][i]) for i in range(start, start + n)]
                start += n
                fwd = sum(at(c, b, 0) for c in layers for b in rows["forward"][j]) if j + 1 < len(u["balance"]) else 0.0
                bwd = sum(at(c, b, 0) + at(c, b, 1) for c in layers for b in rows["backward"][j])
                pred.append(fwd + bwd)
            runs = []
            for log in glob.glob(os.path.join(out, "raw", f"{key}-{mode}-r*.jsonl")):
                e = [json.loads(x) for x in open(log) if x.strip()][2:]
                if e:
                    runs.append([st.median(x["busy_ms"][s] for x in e) for s in range(len(pred))])
            if not runs:
                continue
            meas = [st.median(r[s] for r in runs) for s in range(len(pred))]
            res["measured"][key][mode]["busy_predicted_ms"] = pred
            res["measured"][key][mode]["busy_ms"] = meas
            md.append(f"| {model} | {p} | {mode} | {' / '.join(f'{x:.1f}' for x in pred)} | {' / '.join(f'{x:.1f}' for x in meas)} | "
                      f"{' / '.join(f'{a / b:.2f}' for a, b in zip(meas, pred))} |")
md += ["", "Gain of DGAP over the best equal partition (equal / DGAP - 1):", "",
       "| model | stages | predicted | measured (step) | measured (pass) |", "|---|---|---|---|---|"]
for g in gains:
    md.append(f"| {g['model']} | {g['stages']}{' (2 per core)' if g['stages'] > 2 else ''} | {f(g['predicted'], '{:+.1f}%')} | "
              f"{f(g['step'], '{:+.1f}%')} | {f(g['pass_'], '{:+.1f}%')} |")
json.dump(res, open(os.path.join(out, "results.json"), "w"), indent=1)
open(os.path.join(out, "summary.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
quick_done "$OUT" summary.md results.json
