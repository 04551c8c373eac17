#!/usr/bin/env bash
# Installs the Debian 12 packages pipetrain needs to build, test and benchmark (the same names serve Debian 13:
# make test-libtorch2 runs this script inside its Debian 13 root).
# Idempotent and quiet when everything is present; installs only what is missing.
# Needs root (or sudo) only when something is missing.
set -euo pipefail

PACKAGES=(
  build-essential cmake make
  libtorch-dev libgloo-dev libopenmpi-dev openmpi-bin libopenblas0-openmp
  libcli11-dev nlohmann-json3-dev libfmt-dev zlib1g-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  dataset-fashion-mnist bible-kjv
  time            # /usr/bin/time: the benchmark scripts time their runs with it
  python3-torch   # the PyTorch peer the benchmarks compare against; Debian 13's (2.6) runs pipetrain.torch's test
  pybind11-dev python3-dev  # the Python module (python/, cmake -DPIPETRAIN_PYTHON)
)
# Extra names for testing this script, e.g. PIPETRAIN_EXTRA_DEPS=no-such-package.
if [[ -n "${PIPETRAIN_EXTRA_DEPS:-}" ]]; then
  read -r -a extra <<<"$PIPETRAIN_EXTRA_DEPS"
  PACKAGES+=("${extra[@]}")
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == installed ]] || missing+=("$pkg")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "install-deps: missing Debian packages: ${missing[*]}" >&2
if [[ $(id -u) -eq 0 ]]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO=(sudo)
else
  echo "install-deps: not root; install them with:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
  exit 1
fi

"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
