#!/usr/bin/env bash
# Issue 3's runtime benchmark, side by side in one run (results: docs/BENCHMARKS.md, "Issue 3: runtime").
#
#   bash bench/run_runtime_bench.sh                      # 9-15 min on 2 cores (longer when noisy)
#   ROUNDS=1 STEPS=5 bash bench/run_runtime_bench.sh     # a quick look
#   QUICK=1 bash bench/run_runtime_bench.sh              # `make test`: every configuration once at tiny
#       sizes (m=4, 3 steps; not plain-2t and pipe-1t, which differ from plain-1t and pipe-2t only in the
#       thread count), one other balance and one memory run, into a temporary folder; fails unless every
#       run worked and it wrote its summary (bench/lib/quick.sh). BUILD (default build) is where the
#       programs are; quick mode never builds.
#
# For one GPT (8 blocks, d_model 256, 4 heads, vocab 96, context 128, batch 32) and m in {4, 8}, runs
# ROUNDS interleaved rounds, each running every configuration once:
#   pt-1f1b   pipetrain train --transport gloo --stages 2 --schedule 1f1b --threads 1 --memory   (2 processes x 1 thread)
#   pt-zbh1   the same with --schedule zb-h1
#   pt-1f1b-pin  pt-1f1b with each rank pinned to its own core (taskset), as mpirun binds its ranks
#   pt-mpi    the same 1f1b under mpirun with --transport mpi (if mpirun exists)
#   plain-2t  bench_plain_gpt --threads 2                                       (1 process x 2 threads)
#   plain-1t  bench_plain_gpt --threads 1 --stage-times  (reference; also times each stage's F and BW)
#   pipe-2t   bench/peer_pipe.py, PyTorch Pipe, 2 partitions, torch.set_num_threads(2)
#   pipe-1t   the same with 1 thread (on CPU Pipe runs its partitions serially in one worker thread)
# then, once: the activation-memory runs (gpipe/1f1b at m=4, b=32 and m=8, b=64: the same micro-batch
# of 8 samples; bench_plain_gpt --memory for the per-layer footprint), two other balances, and the
# Gloo/MPI ping-pong at this model's activation sizes. Every step median skips the first 2 steps.
#
# Before each run it waits (up to QUIET_WAIT s) for the CPUs to be idle, since the machine is shared;
# the CPU use seen just before each run is recorded next to its result.
# Raw outputs go to bench/results/runtime/raw/, the summary to bench/results/runtime/summary.{md,json},
# measured and predicted timelines to bench/results/runtime/*.svg.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-6}
QUIET_WAIT=${QUIET_WAIT:-20}
# shellcheck source=bench/lib/quick.sh
source bench/lib/quick.sh  # QUICK, BUILD, bench_out, need_built, quick_done
# The model's shape, which every program takes; pipetrain also needs its data source (the baselines,
# bench_plain_gpt and peer_pipe.py, train on the same synthetic tokens and take no --data flag).
MODEL=(--layers 8 --d-model 256 --heads 4 --vocab 96 --seq-len 128)
PT_DATA=(--data synthetic)
BATCH=32
MS=(4 8)
BALANCES=(parameters 4,6 6,4)
XFER_ITERS=200
if ((QUICK)); then
  ROUNDS=1 STEPS=3 MS=(4) BALANCES=(4,6) XFER_ITERS=5 RETRIES=0
  MODEL=(--layers 8 --d-model 32 --heads 2 --vocab 96 --seq-len 16)
fi
RES=$(bench_out "$ROOT/bench/results/runtime")
RAW=$RES/raw
PY=/usr/bin/python3
# Open MPI 4 (Debian 12) keeps its out-of-band channel on loopback; Open MPI 5 (Debian 13) refuses that.
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader)
if mpirun --version 2>/dev/null | head -1 | grep -qE ' [1-4]\.[0-9]'; then MPIRUN+=(--mca oob_tcp_if_include lo); fi
MPIRUN+=(-n 2)

# --- build, then run private copies (others may rebuild build/ while this runs) -------------------------
if ((QUICK)); then
  need_built "$BUILD/pipetrain" "$BUILD/bench/bench_plain_gpt" "$BUILD/bench/bench_transport"
elif [[ ! -x $BUILD/pipetrain || ! -x $BUILD/bench/bench_plain_gpt || ! -x $BUILD/bench/bench_transport ]]; then
  make build
else
  cmake --build "$BUILD" --target pipetrain bench_plain_gpt bench_transport -j"$(nproc)" >/dev/null
fi
BIN=$(mktemp -d /tmp/pipetrain-bench.XXXXXX)
trap 'rm -rf "$BIN"' EXIT
cp "$BUILD/pipetrain" "$BUILD/pipetrain-torch" "$BUILD/bench/bench_plain_gpt" "$BUILD/bench/bench_transport" "$BIN/"
mkdir -p "$BIN/traces"
rm -rf "$RAW"
mkdir -p "$RAW"

# --- machine facts -----------------------------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "nproc: $(nproc)"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p')"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null) (working tree with uncommitted changes: $(git status --porcelain 2>/dev/null | wc -l) paths)"
  echo "pipetrain info:"
  "$BIN/pipetrain" info | sed 's/^/  /'
  echo "python: $($PY -c 'import torch; print("torch", torch.__version__, "threads default", torch.get_num_threads())')"
  echo "mpirun: $(command -v mpirun || echo none) $(mpirun --version 2>/dev/null | head -1)"
  echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-unset}"
  echo "rounds: $ROUNDS, steps per run: $STEPS (median over steps 3..$STEPS), batch $BATCH, model ${MODEL[*]} ${PT_DATA[*]}"
} >"$RAW/machine.txt"
cat "$RAW/machine.txt"

# --- helpers -----------------------------------------------------------------------------------------
# shellcheck source=bench/lib/load.sh
source bench/lib/load.sh  # cpu_busy, wait_quiet, stat_busy, HZ
LOG=$RAW/runs.tsv
printf 'round\tconfig\tm\tbatch\tcpu_busy_before_pct\tother_cpu_during_pct\twall_s\tfile\n' >"$LOG"
# run NAME ROUND M BATCH -- command...: waits for quiet, runs the command under /usr/bin/time and records
# how much of the machine other processes used meanwhile (all CPU time in /proc/stat minus the run's own).
# A run during which others used >= 10% of the machine is run once more (attempt 2, RETRIES in all);
# both are kept, and the summary's "quiet" medians use only runs with < 5%.
RETRIES=${RETRIES:-12}  # quick mode: 0
ATTEMPT=1
run() {
  local name=$1 round=$2 m=$3 b=$4
  shift 5
  local suffix=""
  ((ATTEMPT > 1)) && suffix="_a$ATTEMPT"
  local file="$RAW/r${round}_${name}_m${m}_b${b}${suffix}.txt"
  local busy s0 s1 wall usr sys other
  busy=$(wait_quiet)
  echo "### $* (cpu busy before: ${busy}%)" >"$file"
  s0=$(stat_busy)
  if ! /usr/bin/time -f '%e %U %S' -o "$BIN/time.txt" "$@" >>"$file" 2>&1; then
    echo "FAILED: $name round $round m=$m (see $file)" | tee -a "$file"
  fi
  s1=$(stat_busy)
  read -r wall usr sys < <(tail -1 "$BIN/time.txt")
  other=$(awk -v d=$((s1 - s0)) -v hz="$HZ" -v w="$wall" -v u="$usr" -v s="$sys" -v n="$(nproc)" \
    'BEGIN { f = (d / hz - (u + s)) / (w * n) * 100; if (f < 0) f = 0; printf "%.0f", f }')
  echo "### wall ${wall} s, own cpu $(awk -v u="$usr" -v s="$sys" 'BEGIN{print u + s}') s, other processes' cpu during the run: ${other}% of the machine" >>"$file"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$name" "$m" "$b" "$busy" "$other" "$wall" "$(basename "$file")" >>"$LOG"
  printf '  %-16s m=%-2s b=%-3s round %s%-3s: %-28s (cpu busy before %s%%, others during %s%%)\n' "$name" "$m" "$b" \
    "$round" "$suffix" "$(grep -Eo '(median step [0-9.]+ ms|"median_step_ms": [0-9.]+)' "$file" | tail -1)" "$busy" "$other"
  if ((other >= 10 && ATTEMPT == 1 && RETRIES > 0)); then
    RETRIES=$((RETRIES - 1))
    ATTEMPT=2
    run "$name" "$round" "$m" "$b" -- "$@"
    ATTEMPT=1
  fi
}
# Adam lr 1e-3 constant, no clipping: the optimizer bench_plain_gpt runs. One progress line per step (step times).
# gloo, as the recorded figures were measured (and pt-1f1b-pin runs): not the default transport (shm).
PT_COMMON=(--transport gloo --stages 2 --threads 1 --memory "${MODEL[@]}" "${PT_DATA[@]}" --batch-size "$BATCH" --steps "$STEPS" --progress lines
           --lr 1e-3 --lr-schedule constant --clip 0)
HAVE_MPI=0
command -v mpirun >/dev/null && HAVE_MPI=1
# The peer, PyTorch's Pipe (torch.distributed.pipeline.sync), exists up to PyTorch 2.3: Debian 12's 1.13 has it,
# Debian 13's 2.6 and pip's 2.x do not. Without it the Pipe rows stay empty and the run says why.
HAVE_PIPE=0
if "$PY" -c 'import torch.distributed.pipeline.sync' 2>/dev/null; then
  HAVE_PIPE=1
else
  echo "peer: this PyTorch ($("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)) has no" \
    "torch.distributed.pipeline.sync.Pipe (removed in PyTorch 2.4): the PyTorch Pipe rows are left out;" \
    "run this benchmark with Debian 12's python3-torch 1.13 to compare against it" | tee "$RAW/peer-missing.txt"
fi

# --- interleaved rounds ------------------------------------------------------------------------------
START=$(date +%s)
for round in $(seq 1 "$ROUNDS"); do
  echo "round $round/$ROUNDS"
  for m in "${MS[@]}"; do
    tr=$BIN/traces/r${round}_m${m}
    run pt-1f1b "$round" "$m" "$BATCH" -- "$BIN/pipetrain" train "${PT_COMMON[@]}" --schedule 1f1b --microbatches "$m" \
      --trace "${tr}_pt-1f1b.json" --svg "${tr}_pt-1f1b.svg"
    run pt-zbh1 "$round" "$m" "$BATCH" -- "$BIN/pipetrain" train "${PT_COMMON[@]}" --schedule zb-h1 --microbatches "$m" \
      --trace "${tr}_pt-zbh1.json" --svg "${tr}_pt-zbh1.svg"
    run pt-1f1b-pin "$round" "$m" "$BATCH" -- "$BIN/pipetrain" launch -n 2 -- sh -c "exec taskset -c \$RANK \
      $BIN/pipetrain train ${PT_COMMON[*]} --schedule 1f1b --microbatches $m --trace ${tr}_pt-1f1b-pin.json"
    if ((HAVE_MPI)); then
      run pt-mpi "$round" "$m" "$BATCH" -- "${MPIRUN[@]}" "$BIN/pipetrain" train "${PT_COMMON[@]}" --transport mpi \
        --schedule 1f1b --microbatches "$m" --trace "${tr}_pt-mpi.json" --svg "${tr}_pt-mpi.svg"
    fi
    ((QUICK)) || run plain-2t "$round" "$m" "$BATCH" -- "$BIN/bench_plain_gpt" "${MODEL[@]}" --batch-size "$BATCH" \
      --microbatches "$m" --steps "$STEPS" --threads 2
    run plain-1t "$round" "$m" "$BATCH" -- "$BIN/bench_plain_gpt" "${MODEL[@]}" --batch-size "$BATCH" --microbatches "$m" \
      --steps "$STEPS" --threads 1 --stage-times
    ((!HAVE_PIPE)) || run pipe-2t "$round" "$m" "$BATCH" -- "$PY" bench/peer_pipe.py "${MODEL[@]}" --batch-size "$BATCH" --microbatches "$m" \
      --steps "$STEPS" --threads 2 --partitions 2
    ((QUICK || !HAVE_PIPE)) || run pipe-1t "$round" "$m" "$BATCH" -- "$PY" bench/peer_pipe.py "${MODEL[@]}" --batch-size "$BATCH" \
      --microbatches "$m" --steps "$STEPS" --threads 1 --partitions 2
  done
done

# --- once: other balances (same model, 1f1b m=4) ------------------------------------------------------
echo "balances"
for bal in "${BALANCES[@]}"; do
  run "pt-1f1b-bal${bal//,/-}" 1 4 "$BATCH" -- "$BIN/pipetrain" train "${PT_COMMON[@]}" --schedule 1f1b --microbatches 4 \
    --balance "$bal" --trace "$BIN/traces/bal${bal//,/-}.json"
done

# --- once: activation memory (micro-batch of 8 samples throughout) ------------------------------------
echo "memory"
RETRIES=0  # memory and transfer sizes do not depend on the noise
MEM_STEPS=3
run mem-gpipe 1 4 32 -- "$BIN/pipetrain" train --stages 2 --threads 1 --memory "${MODEL[@]}" "${PT_DATA[@]}" \
  --schedule gpipe --microbatches 4 --batch-size 32 --steps $MEM_STEPS
if ((!QUICK)); then
  run mem-gpipe 1 8 64 -- "$BIN/pipetrain" train --stages 2 --threads 1 --memory "${MODEL[@]}" "${PT_DATA[@]}" \
    --schedule gpipe --microbatches 8 --batch-size 64 --steps $MEM_STEPS
  run mem-1f1b 1 8 64 -- "$BIN/pipetrain" train --stages 2 --threads 1 --memory "${MODEL[@]}" "${PT_DATA[@]}" \
    --schedule 1f1b --microbatches 8 --batch-size 64 --steps $MEM_STEPS
fi
run mem-plain 1 4 32 -- "$BIN/bench_plain_gpt" "${MODEL[@]}" --batch-size 32 --microbatches 4 --steps 2 --threads 1 --memory

# --- once: Gloo vs MPI per activation transfer at this model's sizes ----------------------------------
echo "transports"
SIZES=$((BATCH / 8 * 128 * 256 * 4)),$((BATCH / 4 * 128 * 256 * 4))  # micro-batch activation at m=8 and m=4
((QUICK)) && SIZES=4096,65536
run xfer-gloo 1 0 0 -- "$BIN/pipetrain" launch -n 2 -- "$BIN/bench_transport" --transport gloo --sizes "$SIZES" --iters $XFER_ITERS
run xfer-gloo-raw 1 0 0 -- "$BIN/pipetrain" launch -n 2 -- "$BIN/bench_transport" --transport gloo-raw --sizes "$SIZES" --iters $XFER_ITERS
if ((HAVE_MPI)); then
  run xfer-mpi 1 0 0 -- "${MPIRUN[@]}" "$BIN/bench_transport" --transport mpi --sizes "$SIZES" --iters $XFER_ITERS
fi
echo "benchmark wall time: $(($(date +%s) - START)) s" | tee -a "$RAW/machine.txt"

# --- summary (and the timelines: measured SVGs of a quiet run, the simulator's from its measured costs) --
RUNTIME_BENCH_MODEL="${MODEL[*]}" "$PY" - "$RES" "$BIN" "$ROUNDS" "$STEPS" <<'EOF'
import glob, json, os, re, shutil, statistics as st, subprocess, sys
res, binp, rounds, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
raw = os.path.join(res, "raw")
pt = os.path.join(binp, "pipetrain")
QUIET = 5  # a run is quiet when other processes used < 5% of the machine during it

def step_times(t):  # every "step k/K ... X ms" line, in order
    return [float(x) for x in re.findall(r"step +\d+/\d+ .*? ([0-9.]+) ms", t)]

def median_skip2(v):
    return st.median(v[2:]) if len(v) > 2 else (st.median(v) if v else float("nan"))

def last_json(t):
    return json.loads(t.split("### wall")[0].strip().splitlines()[-1])

def pt_summary(t):
    d = {}
    m = re.search(r"measured makespan ([0-9.]+) ms, bubble fraction ([0-9.]+); simulated from measured stage costs: "
                  r"makespan ([0-9.]+) ms, bubble fraction ([0-9.]+); efficiency \(predicted/measured\) ([0-9.]+)", t)
    if m:
        d.update(makespan=float(m[1]), bubble=float(m[2]), sim_makespan=float(m[3]), sim_bubble=float(m[4]),
                 efficiency=float(m[5]))
    d["stages"] = [dict(busy=float(a), span=float(b), bubble=float(c), heap_mib=float(h) if h else None)
                   for a, b, c, h in re.findall(r"stage \d+: busy ([0-9.]+) ms, span ([0-9.]+) ms, bubble ([0-9.]+) ms"
                                                r"(?:; peak RSS [0-9.]+ MiB(?: \(one process for all ranks\))?)?"
                                                r"(?:, peak heap growth in a step ([0-9.]+) MiB)?", t)]
    bal = re.search(r"balance ([0-9]+(?:,[0-9]+)*)", t)
    d["balance"] = bal[1] if bal else None
    return d

def trace_costs(path):  # per stage: mean ms of F, B, W, BW; total ms in the transfers and the step
    j = json.load(open(path))
    acc = {}
    for e in j["traceEvents"]:
        if e.get("ph") == "X":
            acc.setdefault(e["tid"], {}).setdefault(e["args"]["kind"], []).append(e["dur"] / 1000.0)  # us -> ms
    out = []
    for r in sorted(acc):
        k = acc[r]
        mean = lambda n: st.mean(k[n]) if n in k else 0.0
        tot = lambda n: sum(k.get(n, []))
        out.append(dict(F=mean("F"), B=mean("B"), W=mean("W"), BW=mean("BW"),
                        compute=tot("F") + tot("B") + tot("W") + tot("BW"),
                        waits=tot("SF") + tot("RF") + tot("SB") + tot("RB"), step=tot("S"),
                        detail={n: round(tot(n), 2) for n in ("SF", "RF", "SB", "RB", "S") if n in k}))
    return out

runs = {}
for f in sorted(glob.glob(os.path.join(raw, "r*_*.txt"))):
    name = os.path.basename(f)[:-4]
    mm = re.match(r"r(\d+)_(.+)_m(\d+)_b(\d+)(?:_a(\d+))?$", name)
    rnd, cfg, m, b, att = int(mm[1]), mm[2], int(mm[3]), int(mm[4]), int(mm[5] or 1)
    t = open(f).read()
    rec = dict(round=rnd, attempt=att, config=cfg, m=m, batch=b, file=os.path.basename(f), steps_ms=step_times(t))
    rec["median_ms"] = median_skip2(rec["steps_ms"])
    rec["busy_before"] = int(re.search(r"cpu busy before: (\d+)%", t)[1])
    o = re.search(r"other processes' cpu during the run: (\d+)%", t)
    rec["other_cpu"] = int(o[1]) if o else 0
    rec["quiet"] = rec["other_cpu"] < QUIET
    rec["failed"] = "FAILED:" in t
    if cfg.startswith(("pt-", "mem-gpipe", "mem-1f1b")):
        rec.update(pt_summary(t))
    if cfg == "plain-1t":
        j = last_json(t)
        rec["stage_f"], rec["stage_bw"] = j.get("stage_f_ms"), j.get("stage_bw_ms")
    if cfg == "pipe-2t":
        pm = re.search(r"parameters: Pipe model (\d+), pipetrain gpt (\d+)", t)
        rec["params"] = [int(pm[1]), int(pm[2])] if pm else None
    if cfg == "mem-plain":
        rec["memory"] = last_json(t)
    if cfg.startswith("xfer-"):
        rec["xfer"] = [dict(bytes=int(a), one_way_us=float(b2), gbps=float(c))
                       for a, b2, c in re.findall(r"^(?:\[rank 0\] )?\S+ +(\d+) +[0-9.]+ +([0-9.]+) +([0-9.]+)$", t, re.M)]
    loss = re.findall(r"loss ([0-9.]+)", t)
    rec["first_loss"] = float(loss[0]) if loss else None
    runs.setdefault((cfg, m, b), []).append(rec)
# Traces and SVGs are per (round, config, m): a retry overwrote the first attempt's, so they belong to the last.
for rs in runs.values():
    for r in rs:
        if r["attempt"] != max(x["attempt"] for x in rs if x["round"] == r["round"]):
            continue
        if r["config"].startswith("pt-1f1b-bal"):
            base = os.path.join(binp, "traces", r["config"].replace("pt-1f1b-", ""))
        else:
            base = os.path.join(binp, "traces", f"r{r['round']}_m{r['m']}_{r['config']}")
        if os.path.exists(base + ".json"):
            r["trace"] = trace_costs(base + ".json")
        if os.path.exists(base + ".svg"):
            r["svg"] = base + ".svg"

def pick(cfg, m, b=32, quiet=True):
    rs = [r for r in runs.get((cfg, m, b), []) if not r["failed"]]
    q = [r for r in rs if r["quiet"]]
    return q if (quiet and q) else rs

def med(cfg, m, key="median_ms", b=32, quiet=True):
    v = [r[key] for r in pick(cfg, m, b, quiet) if r.get(key) is not None]
    return st.median(v) if v else float("nan")

def cell(cfg, m, quiet=True):
    rs = pick(cfg, m, 32, quiet)
    if not rs:
        return "-"
    v = [r["median_ms"] for r in rs]
    nq = sum(r["quiet"] for r in runs.get((cfg, m, 32), []))
    return f"{st.median(v):.0f} [{min(v):.0f}..{max(v):.0f}]" + (f" n={nq}" if quiet else f" n={len(v)}")

configs = [("pt-1f1b", "pipetrain 2 stages 1f1b, gloo (2 proc x 1 thread)"),
           ("pt-zbh1", "pipetrain 2 stages zb-h1, gloo (2 proc x 1 thread)"),
           ("pt-1f1b-pin", "pipetrain 2 stages 1f1b, gloo, ranks pinned to cores"),
           ("pt-mpi", "pipetrain 2 stages 1f1b, mpi (2 proc x 1 thread, bound to cores)"),
           ("plain-2t", "plain LibTorch (1 proc x 2 threads)"),
           ("plain-1t", "plain LibTorch (1 proc x 1 thread)"),
           ("pipe-2t", "PyTorch Pipe, 2 partitions (1 proc x 2 threads)"),
           ("pipe-1t", "PyTorch Pipe, 2 partitions (1 proc x 1 thread)")]
configs = [(c, l) for c, l in configs if (c, 4, 32) in runs]
L = []
nruns = sum(len(v) for v in runs.values())
L.append(f"### Step time (ms), batch 32, {rounds} interleaved rounds, median of steps 3..{steps} per run")
L.append("")
L.append(f"Quiet runs only (other processes used < {QUIET}% of the machine during the run): median over runs "
         "[min..max of the per-run medians], n = quiet runs. Ratios are speed-ups (their time / this time; > 1: this is faster).")
L.append("")
L.append("| configuration | m=4 | m=8 | vs plain 2t (m=4 / m=8) | vs Pipe 2t (m=4 / m=8) |")
L.append("|---|---|---|---|---|")
for c, label in configs:
    r2 = " / ".join(f"{med('plain-2t', m) / med(c, m):.2f}x" for m in (4, 8))
    rp = " / ".join(f"{med('pipe-2t', m) / med(c, m):.2f}x" for m in (4, 8))
    L.append(f"| {label} | {cell(c, 4)} | {cell(c, 8)} | {r2} | {rp} |")
L.append("")
L.append("All runs, quiet or not (first attempts and retries), for comparison:")
L.append("")
L.append("| configuration | m=4 | m=8 | vs plain 2t | vs Pipe 2t |")
L.append("|---|---|---|---|---|")
for c, label in configs:
    r2 = " / ".join(f"{med('plain-2t', m, quiet=False) / med(c, m, quiet=False):.2f}x" for m in (4, 8))
    rp = " / ".join(f"{med('pipe-2t', m, quiet=False) / med(c, m, quiet=False):.2f}x" for m in (4, 8))
    L.append(f"| {label} | {cell(c, 4, False)} | {cell(c, 8, False)} | {r2} | {rp} |")
L.append("")

L.append("### pipetrain: measured against the simulator (last step of each quiet run, medians)")
L.append("")
L.append("Predicted = the simulator run on the same schedule with the run's own measured mean F/B/W per stage "
         "(train's summary). Waits = time inside send/receive actions; S = the step action (all-reduce, clip, optimizer).")
L.append("")
L.append("| run | m | step | makespan | predicted | efficiency | bubble meas / pred | busy s0 / s1 | waits s0 / s1 | S s0 / s1 | peak heap s0 / s1 MiB |")
L.append("|---|---|---|---|---|---|---|---|---|---|---|")
for c in ("pt-1f1b", "pt-zbh1", "pt-1f1b-pin", "pt-mpi"):
    for m in (4, 8):
        rs = [r for r in pick(c, m) if "makespan" in r]
        if not rs:
            continue
        g = lambda f: st.median([f(r) for r in rs])
        gt = lambda f: st.median([f(r) for r in rs if "trace" in r]) if any("trace" in r for r in rs) else float("nan")
        L.append(f"| {c} | {m} | {med(c, m):.0f} | {g(lambda r: r['makespan']):.0f} | {g(lambda r: r['sim_makespan']):.0f} | "
                 f"{g(lambda r: r['efficiency']):.2f} | {g(lambda r: r['bubble']):.3f} / {g(lambda r: r['sim_bubble']):.3f} | "
                 f"{g(lambda r: r['stages'][0]['busy']):.0f} / {g(lambda r: r['stages'][1]['busy']):.0f} | "
                 f"{gt(lambda r: r['trace'][0]['waits']):.0f} / {gt(lambda r: r['trace'][1]['waits']):.0f} | "
                 f"{gt(lambda r: r['trace'][0]['step']):.0f} / {gt(lambda r: r['trace'][1]['step']):.0f} | "
                 f"{g(lambda r: r['stages'][0]['heap_mib'] or 0):.1f} / {g(lambda r: r['stages'][1]['heap_mib'] or 0):.1f} |")
L.append("")
L.append("### Per-stage compute: pipeline actions against the same layers run serially in one plain process")
L.append("")
L.append("Mean ms per micro-batch (quiet runs, medians). plain-1t --stage-times runs stage 0's layers then stage 1's "
         "(input a leaf, as on a pipeline stage) with 1 thread; 'compute / plain' = pipeline busy per stage over m x the plain "
         "stage's F+BW.")
L.append("")
L.append("| run | m | s0 F | s0 B (BW) | s0 W | s1 F | s1 B (BW) | s1 W | compute / plain s0, s1 |")
L.append("|---|---|---|---|---|---|---|---|---|")
plain_stage = {}
for m in (4, 8):
    rs = [r for r in pick("plain-1t", m) if r.get("stage_f")]
    if rs:
        plain_stage[m] = [(st.median([r["stage_f"][s] for r in rs]), st.median([r["stage_bw"][s] for r in rs])) for s in (0, 1)]
for c in ("pt-1f1b", "pt-zbh1", "pt-1f1b-pin", "pt-mpi"):
    for m in (4, 8):
        rs = [r for r in pick(c, m) if "trace" in r]
        if not rs:
            continue
        g = lambda f: st.median([f(r) for r in rs])
        bw = lambda s: g(lambda r: r["trace"][s]["BW"] or r["trace"][s]["B"])
        ratio = " / ".join(f"{g(lambda r: r['stages'][s]['busy']) / (m * sum(plain_stage[m][s])):.2f}" for s in (0, 1)) if m in plain_stage else "-"
        L.append(f"| {c} | {m} | {g(lambda r: r['trace'][0]['F']):.1f} | {bw(0):.1f} | {g(lambda r: r['trace'][0]['W']):.1f} | "
                 f"{g(lambda r: r['trace'][1]['F']):.1f} | {bw(1):.1f} | {g(lambda r: r['trace'][1]['W']):.1f} | {ratio} |")
for m, v in sorted(plain_stage.items()):
    L.append(f"| plain-1t, same stages serially | {m} | {v[0][0]:.1f} | {v[0][1]:.1f} | - | {v[1][0]:.1f} | {v[1][1]:.1f} | - | 1 |")
L.append("")
bal_rows = [(c, r) for (c, m, b), rs in sorted(runs.items()) if c.startswith("pt-1f1b-bal") for r in rs[-1:]]
if bal_rows:
    L.append("### Other balances (1f1b, m=4, one run each; uniform gives 5,5)")
    L.append("")
    L.append("| --balance | layers | step ms | busy s0 / s1 ms | efficiency | other CPU % |")
    L.append("|---|---|---|---|---|---|")
    for c, r in bal_rows:
        L.append(f"| {c.replace('pt-1f1b-bal', '').replace('-', ',')} | {r['balance']} | {r['median_ms']:.0f} | "
                 f"{r['stages'][0]['busy']:.0f} / {r['stages'][1]['busy']:.0f} | {r['efficiency']:.2f} | {r['other_cpu']} |")
    L.append("")

# Activation memory
mem = {}
for key, label in ((("mem-gpipe", 4, 32), "gpipe m=4 b=32"), (("mem-gpipe", 8, 64), "gpipe m=8 b=64"),
                   (("pt-1f1b", 4, 32), "1f1b m=4 b=32"), (("mem-1f1b", 8, 64), "1f1b m=8 b=64")):
    rs = [r for r in runs.get(key, []) if r.get("stages") and r["stages"][0]["heap_mib"] is not None]
    if rs:
        mem[label] = [st.median([r["stages"][s]["heap_mib"] for r in rs]) for s in (0, 1)]
plain_mem = (runs.get(("mem-plain", 4, 32)) or [{}])[0].get("memory", {})
A = plain_mem.get("activation_mib_per_microbatch")
boundary = plain_mem.get("boundary_activation_mib", 0.0)
summary_mem = {}
if mem and A:
    # The model that ran (quick mode's is smaller), 8 blocks cut 5,5: embedding + 4 blocks, 4 blocks + head.
    dims = os.environ.get("RUNTIME_BENCH_MODEL", "").split()
    dim = lambda flag, default: int(dims[dims.index(flag) + 1]) if flag in dims else default
    C, V, T = dim("--d-model", 256), dim("--vocab", 96), dim("--seq-len", 128)
    block = 12 * C * C + 13 * C
    grads = [(V * C + T * C + 4 * block) * 4 / 2**20, (4 * block + 2 * C + V * C) * 4 / 2**20]  # balance 5,5
    per_mb = [A[0], A[1] + boundary]  # stage 1 also keeps its received input
    L.append("### Activation memory (peak heap growth per stage in the last step, MiB; micro-batch of 8 samples)")
    L.append("")
    L.append("| run | stage 0 | stage 1 |")
    L.append("|---|---|---|")
    for k, v in mem.items():
        L.append(f"| {k} | {v[0]:.1f} | {v[1]:.1f} |")
    L.append("")
    if "gpipe m=4 b=32" in mem and "gpipe m=8 b=64" in mem:
        d = [(mem["gpipe m=8 b=64"][s] - mem["gpipe m=4 b=32"][s]) / 4 for s in (0, 1)]
        L.append(f"- per micro-batch from gpipe (m=8 minus m=4, / 4): stage 0 {d[0]:.2f} MiB, stage 1 {d[1]:.2f} MiB")
        summary_mem["per_mb_from_gpipe"] = d
    L.append(f"- per micro-batch from a plain forward with the graph kept (bench_plain_gpt --memory): stage 0 {per_mb[0]:.2f} MiB, "
             f"stage 1 {per_mb[1]:.2f} MiB (incl. its {boundary:.2f} MiB received input)")
    L.append(f"- gradients allocated during the step (parameters x 4 bytes): stage 0 {grads[0]:.2f} MiB, stage 1 {grads[1]:.2f} MiB")
    for k in ("1f1b m=4 b=32", "1f1b m=8 b=64"):
        if k not in mem:
            continue
        m = 4 if "m=4" in k else 8
        for s in (0, 1):
            n = min(2 - s, m)
            act = mem[k][s] - grads[s]
            ratio = act / (n * per_mb[s])
            L.append(f"- {k} stage {s}: heap {mem[k][s]:.1f} - gradients {grads[s]:.1f} = {act:.1f} MiB of activations vs "
                     f"min(p-s,m)={n} x {per_mb[s]:.2f} = {n * per_mb[s]:.1f} MiB: ratio {ratio:.3f} "
                     f"({'within' if abs(ratio - 1) <= 0.10 else 'OUTSIDE'} 10%); excess {act - n * per_mb[s]:.1f} MiB = "
                     f"{(act - n * per_mb[s]) / boundary:.1f} boundary tensors of {boundary:.2f} MiB")
            summary_mem[f"{k} stage {s}"] = dict(heap=mem[k][s], activations=act, expected=n * per_mb[s], ratio=ratio)
    L.append("")

# Transfers
xf = {}
for c in ("xfer-gloo", "xfer-gloo-raw", "xfer-mpi"):
    rs = runs.get((c, 0, 0))
    if rs and rs[-1].get("xfer"):
        xf[c] = rs[-1]["xfer"]
if xf:
    L.append("### Time per activation transfer (one way = half the median ping-pong round trip, 200 iterations)")
    L.append("")
    L.append("| bytes | " + " | ".join(f"{c[5:]} us (GB/s)" for c in xf) + " |")
    L.append("|---|" + "---|" * len(xf))
    for i, row in enumerate(next(iter(xf.values()))):
        L.append(f"| {row['bytes']} | " + " | ".join(f"{xf[c][i]['one_way_us']:.1f} ({xf[c][i]['gbps']:.2f})" for c in xf) + " |")
    L.append("")
    for m in (4, 8):
        size = 32 // m * 128 * 256 * 4
        for c in xf:
            row = [x for x in xf[c] if x["bytes"] == size]
            if row and med("pt-1f1b", m) == med("pt-1f1b", m):
                per_step = 2 * m * row[0]["one_way_us"] / 1000  # m activations + m gradients over the one boundary
                L.append(f"- m={m}, {c[5:]}: 2m = {2 * m} transfers of {size} B per step = {per_step:.1f} ms, "
                         f"{100 * per_step / med('pt-1f1b', m):.2f}% of the 1f1b step")
    L.append("")

oth = [r["other_cpu"] for rs in runs.values() for r in rs]
L.append(f"### Noise: other processes' CPU during runs: median {st.median(oth)}%, max {max(oth)}% of the machine; "
         f"{sum(o >= QUIET for o in oth)} of {len(oth)} runs not quiet (>= {QUIET}%), "
         f"{sum(r['attempt'] > 1 for rs in runs.values() for r in rs)} retries")
noisy = [f"{r['config']} m={r['m']} r{r['round']}{'' if r['attempt'] == 1 else ' retry'}: {r['other_cpu']}% -> {r['median_ms']:.0f} ms"
         for rs in runs.values() for r in rs if not r["quiet"] and r["m"] in (4, 8) and r["steps_ms"]]
if noisy:
    L.append("Not quiet: " + "; ".join(noisy))
L.append("")
losses = sorted({f"{r['first_loss']:.4f}" for k, rs in runs.items() for r in rs
                 if r.get('first_loss') and k[2] == 32 and not k[0].startswith('mem')})
L.append("First-step loss of every run at batch 32 (same model, data and seed => equal): " + ", ".join(losses)
         + ("" if len(losses) <= 1 else "  MISMATCH: the runs did not train the same model"))
pp = (runs.get(("pipe-2t", 4, 32)) or [{}])[0].get("params")
if pp:
    L.append(f"Parameters: Pipe model {pp[0]}, pipetrain gpt {pp[1]}")
L.append("")

# Timelines: the latest quiet run's measured SVG, and the simulator's from its measured costs
for m in (4, 8):
    for c, sched in (("pt-1f1b", "1f1b"), ("pt-zbh1", "zb-h1")):
        rs = [r for r in pick(c, m) if "trace" in r and "svg" in r]
        if not rs:
            continue
        r = max(rs, key=lambda r: (r["quiet"], r["round"]))
        tag = sched.replace("-", "")
        shutil.copy(r["svg"], os.path.join(res, f"{tag}_m{m}_measured.svg"))
        cost = ",".join(f"{s['F']:.3f}:{(s['BW'] or s['B']):.3f}:{s['W']:.3f}" for s in r["trace"])
        out = subprocess.run([pt, "simulate", "--schedule", sched, "--stages", "2", "--microbatches", str(m), "--cost", cost,
                              "--svg", os.path.join(res, f"{tag}_m{m}_predicted.svg"), "--json"], capture_output=True, text=True)
        if out.returncode == 0:
            mk = json.loads(out.stdout)["makespan"]
            L.append(f"- timeline {tag}_m{m}_measured.svg ({r['file']}): makespan {r['makespan']:.1f} ms; "
                     f"{tag}_m{m}_predicted.svg from `pipetrain simulate --schedule {sched} --stages 2 --microbatches {m} "
                     f"--cost {cost}`: {mk:.1f} ms")
        else:
            L.append(f"- simulate failed for {sched} m={m}: {out.stderr.strip()}")

md = "\n".join(L) + "\n"
open(os.path.join(res, "summary.md"), "w").write(md)
json.dump({"runs": {f"{k[0]} m={k[1]} b={k[2]}": v for k, v in runs.items()}, "memory": summary_mem},
          open(os.path.join(res, "summary.json"), "w"), indent=1, default=str)
print(md)
if len(losses) > 1:  # the comparison is void when the runs start from other weights
    print("FAILED: first-step losses differ across runs: " + ", ".join(losses))
    sys.exit(1)
EOF
cp "$RAW/runs.tsv" "$RES/runs.tsv"
quick_done "$RES" summary.md summary.json runs.tsv
