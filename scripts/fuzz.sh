#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (in the `asan` preset: clang,
# ASan + UBSan, the library with libFuzzer's coverage instrumentation) and
# runs each for SECONDS seconds, starting from its seed corpus
# tests/fuzz/corpus/<target>. Prints each target's executions; exits
# non-zero at the first finding (crash, sanitizer report, failed check,
# leak, out-of-memory or timeout), whose input lands in
# build/fuzz/artifacts/<target>/ (replay: build/asan/tests/fuzz/<target> FILE).
#
#   scripts/fuzz.sh SECONDS [TARGET...]       default: every target
#   scripts/fuzz.sh --no-build SECONDS [TARGET...]  runs what is built
#   scripts/fuzz.sh --build-only [TARGET...]  builds them, runs nothing
#   scripts/fuzz.sh --list                    prints the targets
#
# New inputs that reach new code accumulate in build/fuzz/corpus/<target>,
# so later runs continue where earlier ones stopped; the repository's seeds
# are never written. docs/reliability.md has the long-run commands.
set -euo pipefail
cd "$(dirname "$0")/.."

all=(fuzz_attention fuzz_backward fuzz_decode fuzz_linear fuzz_modules fuzz_npy fuzz_safetensors)
# qkv::dist's target exists when the build finds MPI (scripts/setup.sh installs it).
if command -v mpiexec >/dev/null; then all+=(fuzz_distributed); fi
if [ "${1:-}" == --list ]; then
  printf '%s\n' "${all[@]}"
  exit 0
fi
build=1
if [ "${1:-}" == --no-build ]; then
  build=0
  shift
fi
if [ "${1:-}" == --build-only ] && ((build)); then
  seconds=""
elif [ $# -lt 1 ] || ! [[ $1 =~ ^[0-9]+$ ]]; then
  echo "usage: scripts/fuzz.sh [--no-build] SECONDS [TARGET...], scripts/fuzz.sh --build-only" \
    "[TARGET...] or scripts/fuzz.sh --list" >&2
  exit 2
else
  seconds=$1
fi
shift
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then targets=("${all[@]}"); fi
for t in "${targets[@]}"; do
  if [[ ! " ${all[*]} " =~ " $t " ]]; then
    echo "fuzz.sh: unknown target '$t' (expected one of: ${all[*]})" >&2
    exit 2
  fi
done

# One build at a time when several runs start together (one per core).
mkdir -p build
if ((build)); then
  (
    flock 9
    cmake --preset asan >/dev/null
    cmake --build --preset asan -j "$(nproc)" --target "${targets[@]}"
  ) 9>build/fuzz.lock
fi
if [ -z "$seconds" ]; then exit 0; fi

# allocator_may_return_null: an absurd allocation is the library's
# qkv::Error to raise, not ASan's report. The libFuzzer limits make a leak,
# a run over 60 s or 4 GiB of memory a finding.
export ASAN_OPTIONS=${ASAN_OPTIONS:-allocator_may_return_null=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# OpenMPI keeps what MPI_Init allocates until the process ends: not qkv's leaks
# (fuzz_distributed keeps its plugins loaded for this: tests/fuzz/keep_plugins.cpp).
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/fuzz/lsan_mpi.supp}
status=0
for t in "${targets[@]}"; do
  corpus=build/fuzz/corpus/$t
  artifacts=build/fuzz/artifacts/$t
  log=build/fuzz/$t.log
  mkdir -p "$corpus" "$artifacts"
  seeds=tests/fuzz/corpus/$t
  echo "== $t: ${seconds} s"
  if build/asan/tests/fuzz/"$t" -max_total_time="$seconds" -max_len=4096 -timeout=60 \
      -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$artifacts/" \
      "$corpus" "$seeds" >"$log" 2>&1; then
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    echo "   clean: $execs executions ($log)"
  else
    echo "   FINDING (log: $log):"
    grep -E "FINDING|ERROR|SUMMARY|runtime error" "$log" | head -5 | sed 's/^/   /'
    status=1
    break
  fi
done
exit $status
