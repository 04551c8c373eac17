#!/usr/bin/env bash
# The quick test of a benchmark program (bench/CMakeLists.txt): runs it and checks it worked.
#   bash bench/lib/check_run.sh [--file NAME]... REGEX -- COMMAND [ARGS...]
# Every argument @TMP@ (or containing it) is replaced by a fresh temporary folder, removed afterwards.
# Fails (exit 1) when the command fails, when its output (stdout and stderr) has no line matching the
# extended regular expression REGEX, or when a --file NAME is missing or empty in the temporary folder.
set -uo pipefail
files=()
while [[ ${1:-} == --file ]]; do
  files+=("$2")
  shift 2
done
regex=${1:?usage: check_run.sh [--file NAME]... REGEX -- COMMAND...}
shift
[[ ${1:-} == -- ]] && shift
tmp=$(mktemp -d "${TMPDIR:-/tmp}/pipetrain-bench-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
args=()
for a in "$@"; do args+=("${a//@TMP@/$tmp}"); done
"${args[@]}" >"$tmp/.output" 2>&1
rc=$?
cat "$tmp/.output"
ok=1
if ((rc != 0)); then
  echo "check_run: the command exited with status $rc" >&2
  ok=0
fi
if ! grep -Eq -- "$regex" "$tmp/.output"; then
  echo "check_run: no output line matches /$regex/" >&2
  ok=0
fi
for f in "${files[@]}"; do
  if [[ ! -s $tmp/$f ]]; then
    echo "check_run: $f was not written" >&2
    ok=0
  fi
done
((ok)) && echo "check_run: OK" && exit 0
exit 1
