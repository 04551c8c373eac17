# Quick mode of the benchmark scripts (source it from the repository root, before OUT is used).
#
# QUICK=1 bash bench/run_X.sh runs the script at tiny sizes, one round, into a fresh temporary folder
# (never bench/results/), checks with quick_done that it wrote its summary (exit status 1 otherwise) and
# then deletes the folder (KEEP=1 keeps it). `make test` runs every script this way (bench/CMakeLists.txt,
# CTest label `bench`), so a flag a script passes that a program no longer takes fails the tests.
# Quick mode never builds: BUILD (default build) must hold pipetrain and bench/ already.
# Without QUICK the script behaves as before: OUT (if the script honours it) or bench/results/NAME.
QUICK=${QUICK:-0}
BUILD=${BUILD:-build}
if ((QUICK)); then
  QUIET_WAIT=0      # do not wait for idle CPUs,
  LOAD_WINDOW_S=0.1 # and watch the load only briefly
  export LOAD_WINDOW_S
fi

# bench_out DEFAULT: the folder a run writes to (quick: a new temporary folder).
bench_out() {
  if ((QUICK)); then
    mktemp -d "${TMPDIR:-/tmp}/pipetrain-bench-quick.XXXXXX"
  else
    echo "${OUT:-$1}"
  fi
}

# need_built FILE...: quick mode fails when a program is missing; a full run builds it (make build).
# BUILD/pipetrain is the torch-free front: the commands with LibTorch are in pipetrain-torch beside it.
need_built() {
  local f
  for f in "$@" $([[ " $* " == *"/pipetrain "* ]] && echo "$BUILD/pipetrain-torch"); do
    if [[ ! -x $f ]]; then
      if ((QUICK)); then
        echo "quick: $f is not built (build it first, or set BUILD)" >&2
        exit 1
      fi
      make build >/dev/null
      return
    fi
  done
}

# quick_done OUT FILE...: in quick mode, checks every FILE (relative to OUT) exists and is not empty and
# that no output under OUT says FAILED (the scripts mark a failed run so and carry on), then removes OUT
# (unless KEEP=1) and exits 0; otherwise exits 1 naming what is wrong and keeps OUT.
quick_done() {
  ((QUICK)) || return 0
  local out=$1 f ok=1
  shift
  for f in "$@"; do
    if [[ ! -s $out/$f ]]; then
      echo "quick: $out/$f is missing or empty" >&2
      ok=0
    fi
  done
  if grep -rl "FAILED" "$out" >/dev/null 2>&1; then
    echo "quick: a run failed: $(grep -rl "FAILED" "$out" | tr '\n' ' ')" >&2
    ok=0
  fi
  if ((!ok)); then
    echo "quick: FAILED (output kept in $out)" >&2
    exit 1
  fi
  echo "quick: OK, wrote $* (and no run failed)"
  [[ ${KEEP:-0} == 1 ]] && echo "quick: kept $out" || rm -rf "$out"
  exit 0
}
