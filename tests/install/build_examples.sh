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
# A planning-only project: find_package(pipetrain COMPONENTS core) with LibTorch and MPI out of reach.
mkdir -p "$work/core"
printf '%s\n' 'cmake_minimum_required(VERSION 3.25)' 'project(core_only LANGUAGES CXX)' \
  'set(CMAKE_CXX_STANDARD 17)' 'find_package(pipetrain REQUIRED COMPONENTS core)' \
  "add_executable(compare_schedules \"$examples/compare_schedules.cpp\")" \
  'target_link_libraries(compare_schedules PRIVATE pipetrain::core)' >"$work/core/CMakeLists.txt"
cmake -S "$work/core" -B "$work/core/build" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON >/dev/null
cmake --build "$work/core/build" -j2
echo "== compare_schedules (core only, no LibTorch found)"
"$work/core/build/compare_schedules" >/dev/null || { echo "core-only compare_schedules failed" >&2; exit 1; }
# A misspelt component is named, with the ones there are (CMake's own message said only "NOT FOUND").
mkdir -p "$work/typo"
printf '%s\n' 'cmake_minimum_required(VERSION 3.25)' 'project(typo LANGUAGES CXX)' \
  'find_package(pipetrain REQUIRED COMPONENTS runtme)' >"$work/typo/CMakeLists.txt"
if cmake -S "$work/typo" -B "$work/typo/build" -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/typo/log" 2>&1; then
  echo "find_package(pipetrain COMPONENTS runtme) was accepted" >&2; exit 1
fi
grep -q "has no component 'runtme'" "$work/typo/log" || { cat "$work/typo/log" >&2; echo "no component message" >&2; exit 1; }
echo "examples built against the installed package and ran"
