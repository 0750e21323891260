#!/usr/bin/env bash
# Sets up a fresh machine and runs every test: the optimized build, then the
# whole suite again under AddressSanitizer + UndefinedBehaviorSanitizer, then
# each libFuzzer target of tests/fuzz for QKV_FUZZ_SECONDS (default 25 s).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
jobs=$(nproc)
for preset in release asan; do
  echo "== $preset: configure, build, test"
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
  ctest --preset "$preset" -j "$jobs"
done

echo "== fuzz: every target for ${QKV_FUZZ_SECONDS:-25} s"
scripts/fuzz.sh "${QKV_FUZZ_SECONDS:-25}"
