#!/usr/bin/env bash
# Issue 6's study: stages x balance x schedule on the GPT and the CNN, measured in the runtime and
# predicted by the simulator from a measured profile (as the torchgpipe / FairScale / DeepSpeed study
# compares pipelines by stage count and balance type).
#   models     gpt: 8 blocks (10 layers), d_model 128, context 64, synthetic tokens, batch 32
#              cnn: VGG-16 style (16 layers), width 8, Fashion-MNIST, batch 64
#   stages     1, 2, 4 (self-launched processes over the default transport (shm); threads per rank = 2 cores / stages, at least 1)
#   balance    uniform (layer counts), parameters (min-max on parameter counts), time and memory
#              (torchgpipe's block partition on the profile's time and memory, as balance_by_time and
#              balance_by_size), optimal (min-max on the profile's time)
#   schedule   gpipe, 1f1b; m = 4 micro-batches; 8 steps, the median of steps 3..8
# Each cell also gets the simulator's prediction from the profile (pipetrain simulate --profile, 60 us
# per transfer), and 8 and 16 stages are predicted only. Results: bench/results/balance/ (raw outputs,
# results.json, summary.md). About 6-8 minutes on 2 cores.
# QUICK=1 (`make test`): a tiny GPT only, 2 stages, balances memory (block partition) and optimal, 1f1b,
# 3 steps, and 4 stages predicted, into a temporary folder; fails unless it wrote summary.md
# and results.json (bench/lib/quick.sh). BUILD (default build) is where pipetrain is.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
OUT=$(bench_out bench/results/balance)
mkdir -p "$OUT/raw"
need_built "$BUILD/pipetrain"
BIN=$(mktemp -d)/pipetrain
trap 'rm -rf "$(dirname "$BIN")"' EXIT  # also when a run fails
cp "$BUILD/pipetrain" "$BUILD/pipetrain-torch" "$(dirname "$BIN")/"
M=4
MODELS="gpt cnn" STAGES="1 2 4" BALANCES="uniform parameters time memory optimal" SCHEDULES="gpipe 1f1b"
PREDICTED="8 16" STEPS=8 REPEATS=7 SIZES="1 2 4 16"
declare -A FLAGS BATCH
FLAGS[gpt]="--model gpt --data synthetic --layers 8 --d-model 128 --heads 4 --seq-len 64 --vocab 96"
BATCH[gpt]=32
if ((QUICK)); then
  MODELS=gpt STAGES=2 BALANCES="memory optimal" SCHEDULES=1f1b PREDICTED=4 STEPS=3 REPEATS=1 SIZES="1 2"
  FLAGS[gpt]="--model gpt --data synthetic --layers 2 --d-model 32 --heads 2 --seq-len 16 --vocab 96"
fi
export MODELS STAGES BALANCES SCHEDULES PREDICTED
FLAGS[cnn]="--model cnn --data fashion-mnist --eval-samples 64"
BATCH[cnn]=64
declare -A KIND SOLVER
KIND[uniform]=uniform;      SOLVER[uniform]=min-max
KIND[parameters]=parameters; SOLVER[parameters]=min-max
KIND[time]=time;            SOLVER[time]=block-partition
KIND[memory]=memory;        SOLVER[memory]=block-partition
KIND[optimal]=time;         SOLVER[optimal]=min-max
{
  echo "date: $(date -u +%FT%TZ)"
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  "$BIN" info
} >"$OUT/raw/machine.txt" 2>&1

for model in $MODELS; do
  micro=$((BATCH[$model] / M))
  # shellcheck disable=SC2086
  "$BIN" profile ${FLAGS[$model]/--eval-samples 64/} --microbatch-size "$micro" --threads 1 --repeats $REPEATS --sizes $SIZES \
    --out "$OUT/$model-profile.json" >"$OUT/raw/$model-profile.txt"
  for stages in $STAGES; do
    for bal in $BALANCES; do
      [[ $stages == 1 && $bal != uniform ]] && continue
      for schedule in $SCHEDULES; do
        name="$model-p$stages-$bal-$schedule"
        echo "== $name" >&2
        # shellcheck disable=SC2086
        "$BIN" train ${FLAGS[$model]} --stages "$stages" --schedule "$schedule" --microbatches $M \
          --batch-size "${BATCH[$model]}" --steps $STEPS --balance "${KIND[$bal]}" --balance-solver "${SOLVER[$bal]}" \
          --profile "$OUT/$model-profile.json" --memory --progress lines --sample 0 >"$OUT/raw/$name.txt" 2>&1 ||
          echo "FAILED" >>"$OUT/raw/$name.txt"
        "$BIN" simulate --schedule "$schedule" --stages "$stages" --microbatches $M --profile "$OUT/$model-profile.json" \
          --balance "${KIND[$bal]}" --balance-solver "${SOLVER[$bal]}" --latency 60 --json >"$OUT/raw/$name.sim.json" 2>&1 ||
          echo '{"error": "FAILED"}' >"$OUT/raw/$name.sim.json"
      done
    done
  done
  for stages in $PREDICTED; do
    for bal in $BALANCES; do
      "$BIN" simulate --schedule 1f1b --stages "$stages" --microbatches $((2 * stages)) --profile "$OUT/$model-profile.json" \
        --microbatch-size "$(( (BATCH[$model] + 2 * stages - 1) / (2 * stages) ))" \
        --balance "${KIND[$bal]}" --balance-solver "${SOLVER[$bal]}" --latency 60 --json \
        >"$OUT/raw/$model-p$stages-$bal-1f1b.sim.json" 2>&1 || echo '{"error": "FAILED"}' >"$OUT/raw/$model-p$stages-$bal-1f1b.sim.json"
    done
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/raw/machine.txt"

python3 - "$OUT" "$M" <<'PY'
import json, os, re, statistics as st, sys
out, m = sys.argv[1], int(sys.argv[2])
batch = {"gpt": 32, "cnn": 64}
env = lambda k: os.environ[k].split()
rows, res = [], {}
for model in env("MODELS"):
    for stages in map(int, env("STAGES")):
        for bal in env("BALANCES"):
            if stages == 1 and bal != "uniform":
                continue
            for sch in env("SCHEDULES"):
                name = f"{model}-p{stages}-{bal}-{sch}"
                t = open(os.path.join(out, "raw", name + ".txt")).read()
                steps = [float(x) for x in re.findall(r"step +\d+/\d+ .*? ([0-9.]+) ms", t)]
                med = st.median(steps[2:]) if len(steps) > 2 else float("nan")
                busy = [float(x) for x in re.findall(r"stage \d+: busy ([0-9.]+) ms", t)]
                heap = [float(x) for x in re.findall(r"peak heap growth in a step ([0-9.]+) MiB", t)]
                b = re.search(r"balance ([0-9,]+)", t)
                try:
                    sim = json.load(open(os.path.join(out, "raw", name + ".sim.json")))
                except Exception:
                    sim = {}
                rec = dict(model=model, stages=stages, balance=bal, schedule=sch, cut=b[1] if b else None,
                           step_ms=med, samples_per_s=1000 * batch[model] / med if med == med else None,
                           imbalance=max(busy) / st.mean(busy) if busy else None, heap_mib=heap,
                           predicted_ms=sim.get("makespan"), predicted_bubble=sim.get("bubble_fraction"),
                           failed="FAILED" in t)
                res[name] = rec
                rows.append(rec)
    for stages in map(int, env("PREDICTED")):
        for bal in env("BALANCES"):
            name = f"{model}-p{stages}-{bal}-1f1b"
            try:
                sim = json.load(open(os.path.join(out, "raw", name + ".sim.json")))
            except Exception:
                sim = {}
            res[name] = dict(model=model, stages=stages, balance=bal, schedule="1f1b", predicted_ms=sim.get("makespan"),
                             predicted_bubble=sim.get("bubble_fraction"), busy=[s["busy"] for s in sim.get("per_stage", [])])
json.dump(res, open(os.path.join(out, "results.json"), "w"), indent=1)
f = lambda x, fmt: "-" if x is None else fmt.format(x)
md = ["| model | p | balance | schedule | cut | step ms | samples/s | imbalance (max/mean busy) | peak heap MiB per stage | predicted ms | predicted / measured |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    ratio = r["predicted_ms"] / r["step_ms"] if r["predicted_ms"] and r["step_ms"] == r["step_ms"] else None
    md.append(f"| {r['model']} | {r['stages']} | {r['balance']} | {r['schedule']} | {r['cut'] or '-'} | {f(r['step_ms'], '{:.1f}')} | "
              f"{f(r['samples_per_s'], '{:.0f}')} | {f(r['imbalance'], '{:.2f}')} | {' / '.join(f'{h:.1f}' for h in r['heap_mib']) or '-'} | "
              f"{f(r['predicted_ms'], '{:.1f}')} | {f(ratio, '{:.2f}')} |")
md += ["", "Predicted only (1f1b, m = 2p):", "", "| model | p | balance | predicted ms | bubble | imbalance |", "|---|---|---|---|---|---|"]
for name, r in res.items():
    if r["stages"] in map(int, env("PREDICTED")):
        imb = max(r["busy"]) / st.mean(r["busy"]) if r.get("busy") else None
        md.append(f"| {r['model']} | {r['stages']} | {r['balance']} | {f(r['predicted_ms'], '{:.1f}')} | {f(r['predicted_bubble'], '{:.3f}')} | {f(imb, '{:.2f}')} |")
open(os.path.join(out, "summary.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
quick_done "$OUT" summary.md results.json
