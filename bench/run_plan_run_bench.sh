#!/usr/bin/env bash
# Plans that run (issue 28, item 4): the planner's predicted step against the step `train --plan` measures,
# on this machine. For RANKS in 2 and 4:
#   pipetrain profile --threads T --concurrent RANKS --transport shm --sizes ...
#     (T = max(1, cores / RANKS): what train uses; RANKS processes measure the layers at once, as the run's
#     ranks compute at once: PROFILE_CONCURRENT=0 measures one process alone, as before)
#   pipetrain plan --profile P --ranks RANKS [--no-hybrid] --out plan.json     (the chosen plan; a straight pipeline)
#   pipetrain train --plan plan.json --log log.jsonl                           (no other pipeline flag)
# and compares the plan's time_ms with the median step_ms of the steps after the first two (per round;
# then the median over ROUNDS interleaved rounds). Before each profile and run it waits for the CPUs to be
# < 15% busy (at most QUIET_WAIT s) and records the reading; each run's CPU seconds (all its ranks, from
# /usr/bin/time) over its wall time and the ranks' cores show how much of the cores the run got.
# The GPT: 4 blocks, d_model 128, context 64, synthetic tokens, Adam, clip off. With 4 ranks on a 2-core
# machine every rank gets 1 thread and the ranks share the cores (oversubscribed); the table says so.
# BASELINE=DIR (a folder holding another build's pipetrain and pipetrain-torch, e.g. main's build/): every
# profile, plan and run is made with both builds, "before" (BASELINE) and "after" (BUILD), the two runs of
# each plan kind one after the other in every round, and the table gets a build column.
# "profile after / before": the same profile taken again after all the runs, its layers' forward and
# backward time over the first one's: the machine's own drift while the bench ran.
# "step - compute": the step's time beyond its busiest stage's compute (measured: step_ms - the largest
# busy_ms; predicted: time_ms - the largest stage_time_ms x m): the all-reduce, the optimizer step, the
# bubble and the waits.
# Writes bench/results/plan_run/{raw/,summary.md}. About 5 minutes on 2 cores (plus waits for quiet CPUs;
# twice that with BASELINE).
# QUICK=1 (ctest bench_quick_plan_run): a tiny GPT, 3 steps, into a temporary folder; fails unless it
# wrote summary.md (bench/lib/quick.sh). BUILD (default build) is where pipetrain is.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
# shellcheck source=bench/lib/load.sh
source bench/lib/load.sh   # wait_quiet
OUT=$(bench_out bench/results/plan_run)
mkdir -p "$OUT/raw"
need_built "$BUILD/pipetrain"
BINS=$(mktemp -d)
trap 'rm -rf "$BINS"' EXIT  # also when a run fails
LABELS=(this)
if [[ -n ${BASELINE:-} ]]; then
  [[ -x $BASELINE/pipetrain && -x $BASELINE/pipetrain-torch ]] || { echo "BASELINE=$BASELINE holds no pipetrain and pipetrain-torch" >&2; exit 1; }
  LABELS=(before after)
  mkdir "$BINS/before"
  cp "$BASELINE/pipetrain" "$BASELINE/pipetrain-torch" "$BINS/before/"
fi
mkdir "$BINS/${LABELS[-1]}"
cp "$BUILD/pipetrain" "$BUILD/pipetrain-torch" "$BINS/${LABELS[-1]}/"
MODEL=(--model gpt --data synthetic --layers 4 --d-model 128 --heads 4 --vocab 96 --seq-len 64)
MB=4 SIZES=(1 2 4 8 16) STEPS=10 REPEATS=10 BATCH=32 ROUNDS=${ROUNDS:-3}
if ((QUICK)); then
  MODEL=(--model gpt --data synthetic --layers 2 --d-model 32 --heads 2 --vocab 96 --seq-len 16)
  MB=2 SIZES=(1 4) STEPS=3 REPEATS=2 BATCH=8 ROUNDS=1
fi
CORES=$(getconf _NPROCESSORS_ONLN)  # not nproc: it reads OMP_NUM_THREADS
TRAIN=(--steps "$STEPS" --progress lines --eval-every 0 --sample 0 --lr 1e-3 --lr-schedule constant --clip 0)
for R in 2 4; do
  T=$((CORES / R > 0 ? CORES / R : 1))
  for b in "${LABELS[@]}"; do
    wait_quiet >"$OUT/raw/profile-$b-r$R.busy"
    concurrent=()
    ((${PROFILE_CONCURRENT:-1})) && concurrent=(--concurrent "$R")
    "$BINS/$b/pipetrain" profile "${MODEL[@]}" --microbatch-size "$MB" --sizes "${SIZES[@]}" --repeats "$REPEATS" \
      --threads "$T" "${concurrent[@]}" --transport shm --out "$OUT/raw/profile-$b-r$R.json" \
      >"$OUT/raw/profile-$b-r$R.txt" 2>&1
    for kind in chosen pipeline; do
      extra=()
      [[ $kind == pipeline ]] && extra=(--no-hybrid)
      "$BINS/$b/pipetrain" plan --profile "$OUT/raw/profile-$b-r$R.json" --ranks "$R" --batch-size "$BATCH" \
        "${extra[@]}" --out "$OUT/raw/plan-$b-r$R-$kind.json" >"$OUT/raw/plan-$b-r$R-$kind.txt" 2>&1
    done
  done
done
for round in $(seq "$ROUNDS"); do
  for R in 2 4; do
    for kind in chosen pipeline; do
      for b in "${LABELS[@]}"; do
        run="$b-r$R-$kind-$round"
        wait_quiet >"$OUT/raw/train-$run.busy"
        /usr/bin/time -f "%e %U %S" -o "$OUT/raw/train-$run.time" \
          "$BINS/$b/pipetrain" train "${MODEL[@]}" --plan "$OUT/raw/plan-$b-r$R-$kind.json" "${TRAIN[@]}" \
          --log "$OUT/raw/log-$run.jsonl" >"$OUT/raw/train-$run.txt" 2>&1
      done
    done
  done
done
# The same profile again after the runs: how far the machine's own speed moved while the bench ran (a
# prediction cannot be closer to a run than the machine is to itself).
for R in 2 4; do
  T=$((CORES / R > 0 ? CORES / R : 1))
  for b in "${LABELS[@]}"; do
    wait_quiet >"$OUT/raw/profile-$b-r$R-end.busy"
    concurrent=()
    ((${PROFILE_CONCURRENT:-1})) && concurrent=(--concurrent "$R")
    "$BINS/$b/pipetrain" profile "${MODEL[@]}" --microbatch-size "$MB" --repeats "$REPEATS" \
      --threads "$T" "${concurrent[@]}" --out "$OUT/raw/profile-$b-r$R-end.json" >"$OUT/raw/profile-$b-r$R-end.txt" 2>&1
  done
done
python3 - "$OUT" "$CORES" "$ROUNDS" "${LABELS[@]}" <<'PY'
import json, os, re, statistics as st, sys
out, cores, rounds, labels = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
raw = os.path.join(out, "raw")
rows = ["| ranks | plan | " + ("build | " if len(labels) > 1 else "") +
        "stages x replicas, schedule, m, balance | threads per rank | predicted ms | "
        "measured ms: median of rounds (per-round medians) | measured / predicted | "
        "step - compute ms: predicted, measured | CPUs busy before (%) | "
        "compute measured / predicted | cores the run got | profile after the runs / before |",
        "|---|---|" + ("---|" if len(labels) > 1 else "") + "---|---|---|---|---|---|---|---|---|---|"]

def compute_ms(path):  # a profile's forward + backward over all layers, per micro-batch
    layers = json.load(open(path))["layers"]
    return sum(l["forward_ms"] + l["backward_ms"] for l in layers)
blas = ""
for r in (2, 4):
  for kind in ("chosen", "pipeline"):
    for b in labels:
        plan = json.load(open(os.path.join(raw, f"plan-{b}-r{r}-{kind}.json")))
        meds, busy, got, comp, rest = [], [], [], [], []
        # The plan's compute per step of each stage: F + B + W per micro-batch (stage_time_ms) x m.
        predicted_busy = [t * plan["microbatches"] for t in plan["stage_time_ms"]]
        for k in range(1, rounds + 1):
            run = f"{b}-r{r}-{kind}-{k}"
            log = [json.loads(l) for l in open(os.path.join(raw, f"log-{run}.jsonl"))]
            kept = log[2:] if len(log) > 2 else log[-1:]
            meds.append(st.median([e["step_ms"] for e in kept]))
            # The measured compute of each stage (its compute actions, busy_ms) against the plan's, summed
            # over the stages: how much slower the layers ran than the profile measured them.
            comp.append(st.median([sum(e["busy_ms"]) for e in kept]) / sum(predicted_busy))
            rest.append(st.median([e["step_ms"] - max(e["busy_ms"]) for e in kept]))
            busy.append(open(os.path.join(raw, f"train-{run}.busy")).read().split()[-1])
            e, u, s_ = map(float, open(os.path.join(raw, f"train-{run}.time")).read().split()[-3:])
            got.append((u + s_) / e if e > 0 else 0)
            text = open(os.path.join(raw, f"train-{run}.txt")).read()
        med = st.median(meds)
        shape = re.search(r"(\d+ stages[^,\n]*?) over", text)
        threads = re.search(r"\((\d+) threads per rank\)", text)
        found = re.search(r"BLAS: ([^\n]*)", text)
        if found: blas = found[1]
        v = plan.get("virtual_stages", 1)
        desc = (f"{shape[1] if shape else '?'}, {plan['schedule']}" + (f" v={v}" if v > 1 else "") +
                f", m={plan['microbatches']}, {','.join(map(str, plan['balance']))}")
        note = f" (oversubscribed: {r} ranks on {cores} cores)" if r > cores else ""
        build = f"{b} | " if len(labels) > 1 else ""
        rows.append(f"| {r} | {kind} | {build}{desc} | {threads[1] if threads else '?'} | {plan['time_ms']:.1f} | "
                    f"{med:.1f} ({', '.join(f'{x:.1f}' for x in meds)}) | {med / plan['time_ms']:.2f}{note} | "
                    f"{plan['time_ms'] - max(predicted_busy):.1f}, {st.median(rest):.1f} | "
                    f"{', '.join(busy)} | {st.median(comp):.2f} | {', '.join(f'{x:.2f}' for x in got)} | "
                    f"{compute_ms(os.path.join(raw, f'profile-{b}-r{r}-end.json')) / compute_ms(os.path.join(raw, f'profile-{b}-r{r}.json')):.2f} |")
rows.append("")
rows.append(f"BLAS: {blas}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; cores: {cores}")
open(os.path.join(out, "summary.md"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY
quick_done "$OUT" summary.md
