#!/usr/bin/env bash
# Sets up a fresh machine and runs every test: the optimized build, then the
# whole suite again under AddressSanitizer + UndefinedBehaviorSanitizer, then
# the Python package (built by `pip install .` into .venv) and its tests,
# then each libFuzzer target of tests/fuzz for QKV_FUZZ_SECONDS (default 25 s).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh --python
jobs=$(nproc)
for preset in release asan; do
  echo "== $preset: configure, build, test"
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
  ctest --preset "$preset" -j "$jobs"
done

echo "== python: pip install ., then its tests"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation .
.venv/bin/python -m pytest -q python/tests

echo "== fuzz: every target for ${QKV_FUZZ_SECONDS:-25} s"
scripts/fuzz.sh "${QKV_FUZZ_SECONDS:-25}"
