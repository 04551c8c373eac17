#!/usr/bin/env bash
# Stage replication (issue 6, PipeDream's 1F1B-RR) on PipeDream's own VGG-16 profile
# (data/pipedream/vgg16-graph.txt, 39 layers measured at batch 128: --pipedream-batch
# 128), 4 ranks, mini-batch 512, 1 GB/s between ranks, in the simulator (deterministic; no wall-clock time):
#   - what `pipetrain plan` predicts: the best straight pipeline it finds, and PipeDream's planner's plan;
#   - PipeDream's plan (17,22 x replication 3,1) run synchronously as 1F1B-RR by `simulate --replication`,
#     next to the best straight pipeline's balance under gpipe and 1f1b, for m = 8, 16, 32.
# With a profile and --bandwidth the simulator adds the replicated stage's gradient all-reduce (a ring over
# its replicas: 2 (r-1)/r of its parameter bytes per link) to that stage's optimizer step.
# Then a correctness run on this machine: the MLP on synthetic data, --replication 2,1 against --stages 2,
# equal per-step losses. Writes bench/results/replication/summary.md. About 1 minute.
# QUICK=1 (`make test`): m = 8 only and 2 training steps, into a temporary folder; fails unless it wrote
# summary.md (bench/lib/quick.sh). BUILD (default build) is where pipetrain is.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
OUT=$(bench_out bench/results/replication)
mkdir -p "$OUT"
need_built "$BUILD/pipetrain"
P=$BUILD/pipetrain
V=data/pipedream/vgg16-graph.txt  # PipeDream's published profile, in the repository (data/pipedream/README.md)
MS="8 16 32" STEPS=6
if ((QUICK)); then MS=8 STEPS=2; fi
PD=(--pipedream-batch 128)
"$P" plan --profile "$V" "${PD[@]}" --ranks 4 --batch-size 512 --bandwidth 1 --out "$OUT/vgg16-plan.json" >"$OUT/plan.txt"
read -r PD_BAL PD_REP < <(python3 -c "
import json; p = json.load(open('$OUT/vgg16-plan.json'))['pipedream']
print(','.join(map(str, p['balance'])), ','.join(map(str, p['replication'])))")
# The best straight pipeline: the plan's own choice, or the "best straight" row when the replicated plan won.
STRAIGHT=$(awk '/best straight:|  chosen: [a-z0-9-]+ m=/ {print $NF; exit}' "$OUT/plan.txt")
{
  echo "## VGG-16 (PipeDream's profile at batch 128), 4 ranks, mini-batch 512, 1 GB/s"
  echo
  echo '```'
  grep -E "chosen:|best straight:|uniform balance|data parallelism|PipeDream planner|1F1B-RR" "$OUT/plan.txt"
  echo '```'
  echo
  echo "| m | 1F1B-RR $PD_BAL x $PD_REP (ms) | straight $STRAIGHT gpipe (ms) | straight $STRAIGHT 1f1b (ms) | RR speed-up over the better straight |"
  echo "|---|---|---|---|---|"
  for m in $MS; do
    mb=$((512 / m))
    rr=$("$P" simulate --profile "$V" "${PD[@]}" --balance "$PD_BAL" --replication "$PD_REP" --schedule 1f1b -m $m \
         --microbatch-size $mb --bandwidth 1 | awk '/^makespan/ {print $2}')
    gp=$("$P" simulate --profile "$V" "${PD[@]}" --balance "$STRAIGHT" --stages 4 --schedule gpipe -m $m \
         --microbatch-size $mb --bandwidth 1 | awk '/^makespan/ {print $2}')
    ob=$("$P" simulate --profile "$V" "${PD[@]}" --balance "$STRAIGHT" --stages 4 --schedule 1f1b -m $m \
         --microbatch-size $mb --bandwidth 1 | awk '/^makespan/ {print $2}')
    python3 -c "print(f'| $m | {float($rr):.0f} | {float($gp):.0f} | {float($ob):.0f} | {min(float($gp), float($ob)) / float($rr):.2f}x |')"
  done
  echo
  echo "## Correctness on this machine (MLP, synthetic data, $STEPS steps, default transport: shm on one host)"
  COMMON=(--model mlp --data synthetic --steps "$STEPS" --progress lines --lr-schedule constant -m 4)
  a=$("$P" train "${COMMON[@]}" --stages 2 2>&1 | awk '/ step +[0-9]+\//{print $6}' | tr '\n' ' ')
  b=$("$P" train "${COMMON[@]}" --replication 2,1 2>&1 | awk '/ step +[0-9]+\//{print $6}' | tr '\n' ' ')
  c=$("$P" train "${COMMON[@]}" --replication 1,3 2>&1 | awk '/ step +[0-9]+\//{print $6}' | tr '\n' ' ')
  echo
  echo "- --stages 2:          $a"
  echo "- --replication 2,1:   $b"
  echo "- --replication 1,3:   $c"
} >"$OUT/summary.md"
cat "$OUT/summary.md"
if ((QUICK)); then  # every training run printed its losses
  grep -Eq -- "- --stages 2: +[0-9]" "$OUT/summary.md" || echo "FAILED: no losses from --stages 2" >>"$OUT/summary.md"
  grep -Eq -- "- --replication 2,1: +[0-9]" "$OUT/summary.md" || echo "FAILED: no losses from --replication 2,1" >>"$OUT/summary.md"
  grep -Eq -- "- --replication 1,3: +[0-9]" "$OUT/summary.md" || echo "FAILED: no losses from --replication 1,3" >>"$OUT/summary.md"
fi
quick_done "$OUT" summary.md
