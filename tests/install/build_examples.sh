#!/usr/bin/env bash
# Installs the pipetrain build tree BUILD into a temporary prefix, builds EXAMPLES (a separate CMake
# project) against that install, as a user's own project would, and runs each example.
# Usage: build_examples.sh BUILD EXAMPLES [TORCH_DIR]
set -euo pipefail
build=$1 examples=$2 torch_dir=${3:-}
work=$(mktemp -d "${TMPDIR:-/tmp}/pipetrain-install-XXXXXX")
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
test -f "$work/prefix/lib/cmake/pipetrain/pipetrainConfig.cmake"
test -f "$work/prefix/include/pipetrain/runtime/executor.h"
args=(-DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release)
[[ -n "$torch_dir" ]] && args+=(-DTorch_DIR="$torch_dir")
cmake -S "$examples" -B "$work/build" "${args[@]}" >/dev/null
cmake --build "$work/build" -j2
run() {  # run NAME: one example; a failure names it
  echo "== $1"
  "$work/build/$1" || { echo "example $1 failed (exit $?)" >&2; exit 1; }
}
run compare_schedules
run my_mlp
run my_trainer
run tied_transformer
run skips_zbv
run two_inputs
echo "examples built against the installed package and ran"
