#!/usr/bin/env bash
# Compile check of the nccl transport against a real CUDA LibTorch, on a machine without a GPU or CUDA:
# fetches the headers of Debian 13's CUDA LibTorch 2.6 (contrib: libtorch-cuda-dev), NCCL (non-free:
# libnccl-dev) and the CUDA toolkit's headers (non-free: nvidia-cuda-dev, libcu++-dev) as .deb files with
# apt-get download (nothing is installed: no nvidia-cudnn, whose package downloads at install time), unpacks
# their usr/include into ROOT, and compiles src/runtime/transport_nccl.cpp (and transport_board.cpp, which
# it uses) with `g++ -fsyntax-only -DUSE_C10D_NCCL` against them. It proves the code compiles against that
# API (2.6); it links and runs nothing. Not part of `make test` (it downloads about 1.2 GB once).
#
# Usage: bash scripts/check_nccl_compile.sh            (exit 0: both files compile, no warnings shown)
# Variables:
#   ROOT      where the headers are unpacked (default /tmp/cudaroot; never inside the build tree)
#   DEBS      where the .deb files are kept between runs (default /tmp/cudadebs)
#   APT_DIR   an apt configuration for Debian 13 (trixie) main/contrib/non-free: APT_DIR/sources.list, with
#             APT_DIR/state and APT_DIR/cache (default /tmp/aptcuda; made, with `apt-get update`, when it has
#             no sources.list, from the first Debian mirror of this machine's apt sources or DEBIAN13_MIRROR)
#   CXX       the compiler (default g++; this machine's g++ 12 compiles Debian 13's headers)
# The headers come first on the include path; everything else (the C++ library, glibc) is this machine's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
root=${ROOT:-/tmp/cudaroot}
debs=${DEBS:-/tmp/cudadebs}
apt_dir=${APT_DIR:-/tmp/aptcuda}
cxx=${CXX:-g++}
packages=(libtorch-cuda-dev libnccl-dev nvidia-cuda-dev libcu++-dev)

case "$root" in "$repo"/*) echo "check_nccl_compile: ROOT=$root is inside the work tree; pick another" >&2; exit 2;; esac

apt_opts=(-o Dir::Etc::SourceList="$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o Dir::State="$apt_dir/state" -o Dir::Cache="$apt_dir/cache")
if [[ ! -f $apt_dir/sources.list ]]; then
  mirror=${DEBIAN13_MIRROR:-$(grep -rhoE 'https?://[^ ]+/debian/?' /etc/apt/sources.list /etc/apt/sources.list.d 2>/dev/null | head -1)}
  mirror=${mirror:-http://deb.debian.org/debian}
  mkdir -p "$apt_dir/state/lists/partial" "$apt_dir/cache/archives/partial"
  echo "deb $mirror trixie main contrib non-free non-free-firmware" > "$apt_dir/sources.list"
  echo "check_nccl_compile: apt-get update for $mirror trixie (in $apt_dir)"
  apt-get "${apt_opts[@]}" update -qq
fi

mkdir -p "$debs" "$root"
for p in "${packages[@]}"; do
  if ! ls "$debs/${p}"_*.deb >/dev/null 2>&1; then
    echo "check_nccl_compile: downloading $p"
    (cd "$debs" && apt-get "${apt_opts[@]}" download "$p" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
  fi
  deb=$(ls "$debs/${p}"_*.deb | head -1)
  stamp="$root/.$(basename "$deb").unpacked"
  if [[ ! -f $stamp ]]; then
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$root" --wildcards './usr/include/*'
    touch "$stamp"
  fi
done

inc=$root/usr/include
version=$(sed -n 's/^#define TORCH_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' "$inc/torch/csrc/api/include/torch/version.h" | paste -sd.)
echo "check_nccl_compile: LibTorch $version headers (CUDA), $(grep -m1 -oE 'NCCL_VERSION_CODE [0-9]+' "$inc/nccl.h" || echo 'nccl.h'), in $root"
flags=(-std=c++17 -fsyntax-only -Wall -Wextra -DUSE_C10D_NCCL -D_GLIBCXX_USE_CXX11_ABI=1
       -I"$repo/include" -I"$repo/src/runtime" -isystem "$inc" -isystem "$inc/torch/csrc/api/include")

# The check is only worth something if ProcessGroupNCCL.hpp's body was compiled (it is empty without
# USE_C10D_NCCL): its class must be in the preprocessed file.
declared=$("$cxx" "${flags[@]/-fsyntax-only/-E}" "$repo/src/runtime/transport_nccl.cpp" 2>/dev/null |
          grep -cE "class .*ProcessGroupNCCL : public Backend" || true)
if [[ ${declared:-0} -eq 0 ]]; then
  echo "check_nccl_compile: ProcessGroupNCCL is not declared in the preprocessed transport_nccl.cpp" >&2
  exit 1
fi
status=0
for f in src/runtime/transport_nccl.cpp src/runtime/transport_board.cpp; do
  if "$cxx" "${flags[@]}" "$repo/$f"; then
    echo "check_nccl_compile: $f: compiles"
  else
    echo "check_nccl_compile: $f: does not compile against LibTorch $version (CUDA)" >&2
    status=1
  fi
done
exit $status
