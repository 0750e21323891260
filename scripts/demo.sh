#!/usr/bin/env bash
# Sets up a fresh machine, builds qkv and runs `qkv demo` (extra arguments are
# passed on, e.g. --color).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target qkv_cli
exec build/release/qkv demo "$@"
