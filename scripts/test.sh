#!/usr/bin/env bash
# Sets up a fresh machine and runs every test: the optimized build, then the
# whole suite again under AddressSanitizer + UndefinedBehaviorSanitizer, then
# the Python package (built by `pip install .` into .venv) and its tests,
# then each libFuzzer target of tests/fuzz for QKV_FUZZ_SECONDS (default 25 s).
#
#   scripts/test.sh [--json FILE]
#
# At the end, passed or failed, it prints the seconds of every stage (and the
# tests each test stage ran); --json FILE writes the same table as JSON. Each
# stage's output is also kept in build/test-logs/<stage>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/stages.sh

while (($#)); do
  case $1 in
    --json)
      [ $# -ge 2 ] || { echo "test.sh: --json needs a FILE argument" >&2; exit 2; }
      stages_json=$2
      shift 2
      ;;
    *)
      echo "test.sh: unknown argument '$1' (expected: --json FILE)" >&2
      exit 2
      ;;
  esac
done

stage setup scripts/setup.sh --python
jobs=$(nproc)
for preset in release asan; do
  stage "$preset: configure" cmake --preset "$preset"
  stage "$preset: build" cmake --build --preset "$preset" -j "$jobs"
  stage "$preset: test" ctest --preset "$preset" -j "$jobs"
done

stage "python: build" .venv/bin/python -m pip install -q --disable-pip-version-check \
  --no-build-isolation .
stage "python: test" .venv/bin/python -m pytest -q python/tests

seconds=${QKV_FUZZ_SECONDS:-25}
stage "fuzz: build" scripts/fuzz.sh --build-only
for target in $(scripts/fuzz.sh --list); do
  stage "fuzz: $target" scripts/fuzz.sh "$seconds" "$target"
done
