#!/usr/bin/env bash
# `make test-libtorch2`: builds pipetrain against Debian 13's LibTorch 2.6 and runs its tests, in a Debian 13
# ("trixie") root made with debootstrap (minbase) under build/debian13/root. Needs root and Debian's package
# registry (the mirror this machine's apt uses). The root is made once (build/debian13/root.stamp) and reused;
# its packages come from scripts/install-deps.sh, run inside it each time (quiet when nothing is missing).
# The build goes to build/debian13-build (never build/). Inside the root: /proc, /sys (read only), a private tmpfs on /dev/shm
# (the shm transport), and this work tree bind-mounted at /pipetrain; every mount is undone on exit, failure
# or interrupt included.
#
# The suite includes the Python module's tests (ctest -R Python): there, pipetrain.torch's test trains with
# Debian 13's PyTorch 2.6 (python3-torch) under its own pipelining runtime.
#
# Variables: JOBS (all cores), BUILD_TYPE (Release), CTEST_ARGS (extra ctest arguments, e.g. "-R Executor"),
#            PYTHON_ONLY=1: only the torch-free core and the Python module (no LibTorch build, a few minutes),
#            in build/debian13-python, and only the Python tests,
#            DEBIAN13_MIRROR (default: the first Debian mirror of this machine's apt sources).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
base=$repo/build/debian13
root=$base/root
stamp=$base/root.stamp
jobs=${JOBS:-$(nproc)}
build_type=${BUILD_TYPE:-Release}
start=$SECONDS
say() { printf 'test-libtorch2: %s (%d s)\n' "$*" $((SECONDS - start)); }

if [[ $(id -u) -ne 0 ]]; then
  echo "test-libtorch2: needs root (debootstrap, chroot and mounts); run it as root, e.g. sudo make test-libtorch2" >&2
  exit 1
fi

# The mirror: the one apt on this machine uses for Debian (deb822 URIs: or one-line deb ...).
mirror=${DEBIAN13_MIRROR:-}
if [[ -z $mirror ]]; then
  mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
    grep -oE 'https?://[^ ]*/debian/?( |$)' | grep -v security | head -1 | tr -d ' ' || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi

mounts=()
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    umount "${mounts[i]}" 2>/dev/null || umount -l "${mounts[i]}" 2>/dev/null || echo "test-libtorch2: could not unmount ${mounts[i]}" >&2
  done
  mounts=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mount_in() {  # mount_in TARGET mount-args...: mounts unless something is mounted there already
  local target=$1
  shift
  mkdir -p "$target"
  if ! mountpoint -q "$target"; then
    mount "$@" "$target"
    mounts+=("$target")
  fi
}

# 1. The Debian 13 root, once.
if [[ ! -f $stamp ]]; then
  if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  fi
  # Nothing may still be mounted inside a half-made root before it is removed.
  for m in "$root/pipetrain" "$root/dev/shm" "$root/sys" "$root/proc" "$root.partial/proc"; do
    if mountpoint -q "$m"; then umount -l "$m"; fi
  done
  if grep -qF " $base/" /proc/mounts; then
    echo "test-libtorch2: something is still mounted under $base; unmount it first:" >&2
    grep -F " $base/" /proc/mounts >&2
    exit 1
  fi
  rm -rf "$root" "$root.partial"
  mkdir -p "$base"
  say "debootstrap --variant=minbase trixie from $mirror"
  debootstrap --variant=minbase trixie "$root.partial" "$mirror" >"$base/debootstrap.log" 2>&1 ||
    { tail -20 "$base/debootstrap.log"; echo "test-libtorch2: debootstrap failed ($base/debootstrap.log)" >&2; exit 1; }
  mv "$root.partial" "$root"
  printf '127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
  date -u +%FT%TZ >"$stamp"
  say "Debian 13 root ready"
fi

mount_in "$root/proc" -t proc proc
mount_in "$root/sys" -t sysfs -o ro sysfs  # Open MPI's hwloc reads the CPU topology there
mount_in "$root/dev/shm" -t tmpfs -o size=4g,mode=1777 tmpfs
mount_in "$root/pipetrain" --bind "$repo"

in_root() { chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 CI="${CI:-}" "$@"; }

# 2. The build dependencies: the project's own list (the same package names exist in Debian 13).
say "installing what is missing in the root (scripts/install-deps.sh)"
in_root bash /pipetrain/scripts/install-deps.sh
in_root bash -c 'echo "LibTorch $(dpkg-query -W -f="\${Version}" libtorch-dev), g++ $(g++ -dumpversion), cmake $(cmake --version | head -1 | cut -d" " -f3)"'

# 3. Build and test.
if [[ ${PYTHON_ONLY:-0} == 1 ]]; then
  in_root python3 -c 'import torch; print("PyTorch", torch.__version__)'
  say "configuring build/debian13-python (core and the Python module only)"
  in_root cmake -S /pipetrain -B /pipetrain/build/debian13-python -DCMAKE_BUILD_TYPE="$build_type" -DPIPETRAIN_CORE_ONLY=ON \
    -DPIPETRAIN_PYTHON=ON >"$base/configure-python.log" 2>&1 || { cat "$base/configure-python.log"; exit 1; }
  say "building the Python module (-j$jobs)"
  in_root cmake --build /pipetrain/build/debian13-python -j"$jobs" --target pipetrain_python
  say "running the Python tests"
  in_root bash -c 'cd /pipetrain/build/debian13-python && ctest --output-on-failure -R "^Python\." "$@"' ctest
  say "Python module and PyTorch 2.6 tests passed"
  exit 0
fi
say "configuring build/debian13-build"
in_root cmake -S /pipetrain -B /pipetrain/build/debian13-build -DCMAKE_BUILD_TYPE="$build_type" >"$base/configure.log" 2>&1 ||
  { cat "$base/configure.log"; exit 1; }
grep -E "pipetrain: (LibTorch|gloo)" "$base/configure.log" || true
say "building (-j$jobs)"
in_root cmake --build /pipetrain/build/debian13-build -j"$jobs"
say "running the tests"
read -r -a ctest_args <<<"${CTEST_ARGS:-}"
in_root bash -c 'cd /pipetrain/build/debian13-build && LSAN_OPTIONS=suppressions=/pipetrain/scripts/lsan.supp ctest --output-on-failure -j2 "$@"' \
  ctest "${ctest_args[@]}"
say "LibTorch 2.6 build and tests passed"
