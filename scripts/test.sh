#!/usr/bin/env bash
# Sets up a fresh machine and runs every test:
#   1. the optimized build (`release` preset) and its C++ tests;
#   2. the Python package, its extension linking that build's library
#      (`pip install .` into .venv), and its tests on every core (pytest-xdist);
#   3. the C++ tests again under AddressSanitizer + UndefinedBehaviorSanitizer
#      (`asan` preset: clang, which also builds the libFuzzer targets);
#   4. each fuzz target for QKV_FUZZ_SECONDS (default 25 s), one per core.
#
#   scripts/test.sh [--quick] [--json FILE]
#
# --quick, for the edit-compile-test loop: steps 1 and 2 without the tests
# labelled slow (C++: ctest label `slow`; Python: marker `slow`).
#
# Compilers run through ccache when it is installed (scripts/setup.sh installs
# it; its cache is ~/.cache/ccache, outside the checkout, so a second clone
# compiles from it). At the end, passed or failed, it prints the seconds of
# every stage and the tests each test stage ran; --json FILE writes the same
# table as JSON. Each stage's output is also kept in build/test-logs/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/stages.sh

quick=0
while (($#)); do
  case $1 in
    --quick)
      quick=1
      shift
      ;;
    --json)
      [ $# -ge 2 ] || { echo "test.sh: --json needs a FILE argument" >&2; exit 2; }
      stages_json=$2
      shift 2
      ;;
    *)
      echo "test.sh: unknown argument '$1' (expected --quick or --json FILE)" >&2
      exit 2
      ;;
  esac
done

stage "setup: Debian packages" scripts/setup.sh
# .venv (minutes from pip's cache on a fresh clone) while the C++ compiles.
stage_bg "setup: Python packages" scripts/setup.sh --python-only
if command -v ccache >/dev/null; then
  # Paths below the checkout are hashed relative to it, and the working
  # directory is left out of the hash, so that any clone hits the cache.
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
fi
jobs=$(nproc)
slow_ctest=()
slow_pytest=()
if ((quick)); then
  slow_ctest=(-LE slow)
  slow_pytest=(-m "not slow")
fi

stage "release: configure" cmake --preset release
stage "release: build" cmake --build --preset release -j "$jobs"
stage_wait
# One test per core, each on one OpenMP thread (the tests of thread counts set
# their own): with every test's pool at one thread per core, the tests took
# a fifth longer.
stage "release: test" env OMP_NUM_THREADS=1 ctest --preset release -j "$jobs" "${slow_ctest[@]}"

# The extension links build/release's library (built above from the same
# sources with the same flags) instead of compiling it again; its own build
# tree is build/python-release, apart from a plain `pip install .`'s.
stage "python: build" .venv/bin/python -m pip install -q --disable-pip-version-check \
  --no-build-isolation -C build-dir=build/python-release \
  -C cmake.define.QKV_PYTHON_PREBUILT="$PWD/build/release" .
# One worker per core, each on one thread: with torch's and qkv's thread pools
# at their default (one thread per core in every worker), the run was twice as
# slow as a single worker.
stage "python: test" env OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n "$jobs" \
  --dist worksteal --durations=20 "${slow_pytest[@]}" python/tests
if ((quick)); then exit 0; fi

stage "asan: configure" cmake --preset asan
stage "asan: build" cmake --build --preset asan -j "$jobs"
# The preset runs a share of the slow sweeps' cases (tests/sweep_sample.hpp),
# drawn by this seed; QKV_SWEEP_SEED=<seed> ctest --preset asan replays them.
export QKV_SWEEP_SEED=${QKV_SWEEP_SEED:-$(date +%s)}
echo "== asan: the sweeps' cases drawn with QKV_SWEEP_SEED=$QKV_SWEEP_SEED"
stage "asan: test" env OMP_NUM_THREADS=1 ctest --preset asan -j "$jobs"

# The fuzz targets, built above, one per core at a time.
seconds=${QKV_FUZZ_SECONDS:-25}
targets=($(scripts/fuzz.sh --list))
for ((i = 0; i < ${#targets[@]}; i += jobs)); do
  for target in "${targets[@]:i:jobs}"; do
    stage_bg "fuzz: $target" scripts/fuzz.sh --no-build "$seconds" "$target"
  done
  stage_wait
done
