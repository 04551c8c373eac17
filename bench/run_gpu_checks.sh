#!/usr/bin/env bash
# The GPU checks of issue 26 (docs/BENCHMARKS.md), for a build against a CUDA LibTorch on a machine with
# an NVIDIA GPU: the CUDA tests of test_runtime, selftest on the GPU for the zoo's models (every
# synchronous schedule), the 8-block GPT of the issue trained on one GPU by 1 and 2 ranks (fp32 and bf16,
# 1f1b and zb-h1 with each backward split), the nccl transport at world size 1 (its tests, and the GPT
# trained by one rank over it; two ranks need two GPUs and are not run), a profile on the GPU and the
# simulator's prediction from it, and the optimizer step against LibTorch's. Prints everything; nothing is
# written outside OUT_DIR.
#
#   bash bench/run_gpu_checks.sh BUILD_DIR [OUT_DIR]       (a build dir holding pipetrain, test_runtime, bench/)
#   QUICK=1 bash bench/run_gpu_checks.sh BUILD_DIR          (the test suite's run: the CPU, tiny sizes)
# With FMNIST_DIR set (the four Fashion-MNIST IDX files), also selftest of the cnn and the unet.
set -uo pipefail
B=${1:?usage: bash bench/run_gpu_checks.sh BUILD_DIR [OUT_DIR]}
if [[ -n ${2:-} ]]; then OUT=$2; else OUT=$(mktemp -d); trap 'rm -rf "$OUT"' EXIT; fi
mkdir -p "$OUT"
if [[ ${QUICK:-0} == 1 ]]; then
  DEV=cpu; LAYERS=1; D=32; HEADS=2; SEQ=16; VOCAB=32; BATCH=8; STEPS=3
else
  DEV=cuda; LAYERS=8; D=512; HEADS=8; SEQ=256; VOCAB=256; BATCH=32; STEPS=30
fi
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
status=0
run() { t "$*"; "$@" || { echo "FAILED ($?): $*"; status=1; }; }
[[ $DEV == cuda ]] && run "$B/test_runtime" --gtest_filter='Device*:FusedOptimizer.*:NcclTransport.*:NcclOnGpu.*' --gtest_brief=1
S=(--data synthetic --transport local --device $DEV --stages 2 --microbatch-counts 1 4)
for m in gpt mlp; do run "$B/pipetrain" selftest --model $m "${S[@]}"; done
run "$B/pipetrain" selftest --model gpt --tie-embeddings "${S[@]}"
run "$B/pipetrain" selftest --model mlp --precision bf16 --tolerance 1e-3 "${S[@]}"
[[ $DEV == cuda ]] && run "$B/pipetrain" selftest --model gpt --precision bf16 --tolerance 1e-3 "${S[@]}"
if [[ -n ${FMNIST_DIR:-} ]]; then
  for m in cnn unet; do
    run "$B/pipetrain" selftest --model $m --data fashion-mnist --data-dir "$FMNIST_DIR" --transport local \
      --device $DEV --stages 2 --microbatch-counts 4
  done
fi
G=(--model gpt --data synthetic --layers $LAYERS --d-model $D --heads $HEADS --seq-len $SEQ --vocab $VOCAB
   --batch-size $BATCH -m 4 --steps $STEPS --eval-every 0 --sample 0 --optimizer adam --progress quiet --device $DEV)
for c in "--stages 1" "--stages 2" "--stages 2 --schedule zb-h1" "--stages 2 --schedule zb-h1 --backward-split explicit" \
         "--stages 1 --precision bf16" "--stages 2 --precision bf16"; do
  # shellcheck disable=SC2086
  run "$B/pipetrain" train "${G[@]}" --transport local $c
done
# The nccl transport. On the GPU: one rank trains over it (a build without NCCL says so, and it is skipped).
# QUICK (CPU): it must refuse at once with exit 2 (no NCCL in this build, or CPU ranks), never hang.
t "pipetrain train --transport nccl --stages 1 (--device $DEV)"
nccl_out=$(timeout 300 "$B/pipetrain" train "${G[@]}" --transport nccl --stages 1 2>&1); nccl_rc=$?
if [[ $DEV == cuda && $nccl_out == *"built against a LibTorch without NCCL"* ]]; then
  echo "SKIPPED (this build has no nccl transport): $(echo "$nccl_out" | tail -1)"
elif [[ $DEV == cuda ]]; then
  echo "$nccl_out" | tail -5
  [[ $nccl_rc == 0 ]] || { echo "FAILED ($nccl_rc): train --transport nccl --stages 1"; status=1; }
elif [[ $nccl_rc == 2 && ( $nccl_out == *"without NCCL"* || $nccl_out == *"moves CUDA tensors"* ) ]]; then
  echo "refused as expected: $(echo "$nccl_out" | tail -1)"
else
  echo "$nccl_out" | tail -5; echo "FAILED ($nccl_rc): train --transport nccl on the CPU must exit 2 with the reason"; status=1
fi
run "$B/pipetrain" profile --model gpt --data synthetic --layers $LAYERS --d-model $D --heads $HEADS --seq-len $SEQ \
  --vocab $VOCAB --microbatch-size $((BATCH / 4)) --device $DEV --out "$OUT/gpt-profile.json"
run "$B/pipetrain" simulate --profile "$OUT/gpt-profile.json" --stages 1 --schedule 1f1b --microbatches 4
if [[ ${QUICK:-0} == 1 ]]; then run "$B/bench/bench_optimizer_step" --quick
else run "$B/bench/bench_optimizer_step" --device cuda; fi
t "done"
exit $status
