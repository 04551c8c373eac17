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
# Issue 26's benchmark too: the same GPT in plain PyTorch (bench/gpt_reference.py, eager and torch.compile;
# its first loss must equal pipetrain's), and 1, 2 and 4 ranks on the GPU at m=8. PYTHON names the
# interpreter whose torch to use (default python3). LARGE=1 adds the large GPT (d_model 2048, 16 blocks,
# context 1024, bf16) on 2 ranks for 1f1b, zb-h1, zb-v, v-min and interleaved (minutes of GPU time).
set -uo pipefail
B=${1:?usage: bash bench/run_gpu_checks.sh BUILD_DIR [OUT_DIR]}
if [[ -n ${2:-} ]]; then OUT=$2; else OUT=$(mktemp -d); trap 'rm -rf "$OUT"' EXIT; fi
mkdir -p "$OUT"
if [[ ${QUICK:-0} == 1 ]]; then
  DEV=cpu; LAYERS=2; D=32; HEADS=2; SEQ=16; VOCAB=32; BATCH=8; STEPS=3
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
for c in "--stages 1" "--stages 2 --memory" "--stages 2 --schedule zb-h1" "--stages 2 --schedule zb-h1 --backward-split explicit" \
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
# The same GPT in plain PyTorch, against pipetrain's one stage (the same weights and data: the first
# losses must agree; on a GPU within 2e-3, its kernels differ from run to run).
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-}
if [[ -z $PY ]]; then  # the first python3 whose torch imports
  for c in python3 /usr/bin/python3; do
    if "$c" -c "import torch" 2>/dev/null; then PY=$c; break; fi
  done
  PY=${PY:-python3}
fi
SHAPE=(--layers $LAYERS --d-model $D --heads $HEADS --seq-len $SEQ --vocab $VOCAB --batch-size $BATCH)
ref_loss=""
t "gpt_reference.py eager"
if ref=$("$PY" "$HERE/gpt_reference.py" "${SHAPE[@]}" --microbatches 4 --steps $STEPS --skip 1 --device $DEV 2>&1); then
  echo "$ref" | tail -2
  ref_loss=$(echo "$ref" | tail -1 | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["first_loss"])')
else
  echo "$ref" | tail -5; echo "FAILED: gpt_reference.py"; status=1
fi
t "pipetrain train --stages 1 --log (first loss against the reference's)"
if "$B/pipetrain" train "${G[@]}" --transport local --stages 1 --log "$OUT/one.jsonl" > "$OUT/one.txt" 2>&1 && [[ -n $ref_loss ]]; then
  "$PY" - "$OUT/one.jsonl" "$ref_loss" "$DEV" <<'PYEOF' || status=1
import json, sys
ours = json.loads(open(sys.argv[1]).readline())["loss"]
ref, dev = float(sys.argv[2]), sys.argv[3]
tol = 2e-3 if dev == "cuda" else 1e-4
print(f"first loss: pipetrain {ours:.4f}, plain PyTorch {ref:.4f}")
if abs(ours - ref) > tol:
    sys.exit(f"FAILED: the first losses differ by more than {tol}: not the same model and data")
PYEOF
else
  tail -5 "$OUT/one.txt"; echo "FAILED: train --stages 1 --log, or no reference loss"; status=1
fi
if [[ $DEV == cuda ]]; then
  run "$PY" "$HERE/gpt_reference.py" "${SHAPE[@]}" --microbatches 4 --steps $STEPS --device cuda --compile
  run "$PY" "$HERE/gpt_reference.py" "${SHAPE[@]}" --microbatches 4 --steps $STEPS --device cuda --fused
fi
# Pipelining on one GPU can only add overhead: 1, 2 and 4 ranks (threads) at m=8.
for st in 1 2 4; do
  run "$B/pipetrain" train "${G[@]}" --transport local --stages $st -m 8
done
run "$B/pipetrain" profile --model gpt --data synthetic --layers $LAYERS --d-model $D --heads $HEADS --seq-len $SEQ \
  --vocab $VOCAB --microbatch-size $((BATCH / 4)) --device $DEV --out "$OUT/gpt-profile.json"
t "simulate --profile (the prediction against train's measured median step, one rank, m=4)"
if sim=$("$B/pipetrain" simulate --profile "$OUT/gpt-profile.json" --stages 1 --schedule 1f1b --microbatches 4 2>&1); then
  echo "$sim" | head -3
  predicted=$(echo "$sim" | sed -n 's/^makespan \([0-9.]*\) ms.*/\1/p')
  measured=$(sed -n 's/.*median step \([0-9.]*\) ms.*/\1/p' "$OUT/one.txt" | head -1)
  if [[ -n $predicted && -n $measured ]]; then
    echo "prediction: $predicted ms per step from the profile, train measured $measured ms:" \
      "predicted/measured $(awk -v p="$predicted" -v m="$measured" 'BEGIN { printf "%.2f", p / m }')"
  else
    echo "FAILED: no makespan in simulate's output or no median step in train's"; status=1
  fi
else
  echo "$sim" | tail -5; echo "FAILED: simulate --profile"; status=1
fi
if [[ ${QUICK:-0} == 1 ]]; then run "$B/bench/bench_optimizer_step" --quick
else run "$B/bench/bench_optimizer_step" --device cuda; fi
# The same steps in plain LibTorch C++ (bench_plain_gpt: LibTorch's Adam, no pipeline): separates what
# pipetrain adds from what LibTorch's C++ operators cost against PyTorch's eager Python.
run "$B/bench/bench_plain_gpt" "${SHAPE[@]}" --microbatches 4 --steps $STEPS --device $DEV
# Last, as the longest (a time limit cuts it, not the checks above). lr 3e-4: at train's default 3e-3 this
# 0.8-billion-parameter GPT's loss rose over the 6 steps (5.81 -> 6.99 on an H200), at 3e-4 it falls.
if [[ ${LARGE:-0} == 1 && $DEV == cuda ]]; then
  L=(--model gpt --data synthetic --layers 16 --d-model 2048 --heads 16 --seq-len 1024 --vocab 256 --batch-size 16
     -m 8 --steps 6 --eval-every 0 --sample 0 --optimizer adam --lr 3e-4 --progress quiet --device cuda --precision bf16
     --transport local --stages 2)
  for sc in "1f1b" "zb-h1" "zb-v" "v-min" "interleaved --virtual 2"; do
    # shellcheck disable=SC2086
    run "$B/pipetrain" train "${L[@]}" --schedule $sc
  done
fi
t "done"
exit $status
