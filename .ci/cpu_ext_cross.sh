#!/usr/bin/env bash
# Cross-check the aarch64 CPU Adam kernels (NEON and SVE) on an x86 host.
#
# Builds cpu_ext/csrc/test_kernels.cpp statically for aarch64 and runs it under qemu-user with SVE at 128,
# 256 and 512 bits (dispatch must pick "sve") and with SVE off (must pick "neon" and not die of SIGILL).
# Installs g++-aarch64-linux-gnu and qemu-user with apt-get when they are missing.
#
# Two builds:
#   * -march=armv8-a: how the op library is built (no -march flag); SVE code only inside functions with
#     target("+sve"). This one must run under every -cpu setting, SVE off included.
#   * -march=armv8.2-a+sve: SVE as the baseline (e.g. a -march=native build on Grace). The compiler may emit
#     SVE anywhere, so it runs only where SVE exists (under sve=off it dies of SIGILL, by design), and only
#     at 128 bits to keep the emulation time down.
#
# Exit status: 0 pass, 1 failure, 77 tools missing and not installable (the pytest wrapper skips on 77
# unless CI is set).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="$root/cpu_ext/csrc/test_kernels.cpp"

missing=()
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || missing+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null 2>&1 || missing+=(qemu-user)
if ((${#missing[@]})); then
  sudo=""
  if [[ "$(id -u)" -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 && sudo="sudo -n" || { echo "need root or sudo to install ${missing[*]}"; exit 77; }
  fi
  command -v apt-get >/dev/null 2>&1 || { echo "apt-get not found; install ${missing[*]} by hand"; exit 77; }
  echo "installing ${missing[*]}"
  if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
      --no-install-recommends "${missing[@]}"; } >/tmp/cpu_ext_cross_apt.log 2>&1; then
    tail -n 20 /tmp/cpu_ext_cross_apt.log
    echo "apt-get install failed"
    exit 77
  fi
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
flags=(-O2 -std=c++17 -static -ffp-contract=off -fno-math-errno -fopenmp-simd -Wall -Wextra)
# The two builds and the five emulated runs are independent: run them side by side (CI has 2 cores), print
# each run's output in order.
aarch64-linux-gnu-g++ "${flags[@]}" -march=armv8-a "$src" -o "$out/test_base" &
base_pid=$!
aarch64-linux-gnu-g++ "${flags[@]}" -march=armv8.2-a+sve "$src" -o "$out/test_sve"
wait "$base_pid"

runs=()
run() {  # run <binary> <qemu -cpu> <expected path>: started in the background, output in $out/run<k>.log
  local k=${#runs[@]}
  { echo "== $(basename "$1") -cpu $2 (expect $3)"
    qemu-aarch64 -cpu "$2" "$1" --quick --expect-best="$3" || echo "FAILED: $(basename "$1") under -cpu $2"
  } > "$out/run$k.log" 2>&1 &
  runs+=($!)
}
for vl in 128 256 512; do
  run "$out/test_base" "max,sve${vl}=on" sve
done
run "$out/test_base" "max,sve=off" neon
# One vector length suffices for the SVE-baseline build (qemu emulates it slowly: ~14 s at 512 bits).
run "$out/test_sve" "max,sve128=on" sve
for pid in "${runs[@]}"; do wait "$pid" || true; done
status=0
for k in "${!runs[@]}"; do
  cat "$out/run$k.log"
  ! grep -q "^FAILED: " "$out/run$k.log" || status=1
done
exit "$status"
