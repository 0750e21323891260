#!/usr/bin/env bash
# Installs the Debian packages qkv needs to build and test, only those that
# are missing (so a second run does nothing), and with --python the Python
# package's dependencies into .venv. Safe to run repeatedly.
#
#   scripts/setup.sh [--python | --python-only]
#
# --python-only: .venv alone (scripts/test.sh installs it while it compiles).
set -euo pipefail

case ${1:-} in
  "") debian=1 python=0 ;;
  --python) debian=1 python=1 ;;
  --python-only) debian=0 python=1 ;;
  *)
    echo "setup.sh: unknown argument '$1' (expected --python or --python-only)" >&2
    exit 2
    ;;
esac

packages=(
  cmake ninja-build g++ pkg-config clang-format
  ccache              # compiler cache (~/.cache/ccache): a second clone compiles from it
  libhwy-dev          # Highway: SIMD with runtime dispatch
  libomp-dev          # OpenMP headers (GCC's libgomp comes with g++)
  libgtest-dev libgmock-dev
  libbenchmark-dev    # Google Benchmark
  libcli11-dev        # command line parsing for the qkv tool
  libopenblas-openmp-dev  # GEMM for the modules' projections and the bench's naive baseline
                          # (the OpenMP build: its threads are qkv's, never nested)
  nlohmann-json3-dev  # JSON headers of safetensors files
  libstb-dev          # stb_image_write, stb_image, stb_easy_font: the tool's PNG pictures
  clang libclang-rt-dev  # libFuzzer and the sanitizers' runtimes for tests/fuzz
  libopenmpi-dev openmpi-bin  # MPI for qkv::dist (context-parallel attention) and mpiexec
  chromium chromium-driver    # headless browser of the attention explorer's test
)

missing=()
for p in "${packages[@]}"; do
  if ((debian)) && ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# With --python, also the Python package's build and test dependencies, in
# a virtual environment at .venv (created once; pip skips what is there).
# --no-compile: pip writes no bytecode for the thousands of modules it
# installs (.venv from pip's cache took 188 s with it, 102 s without, on a
# 2-core VM); Python compiles a module when it is first imported.
if ((python)); then
  cd "$(dirname "$0")/.."
  python=${QKV_PYTHON:-python3}
  if [ ! -x .venv/bin/python ]; then
    if ! "$python" -m venv .venv; then
      echo "setup: installing python3-venv"
      sudo_cmd=()
      if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
      "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends python3-venv
      rm -rf .venv
      "$python" -m venv .venv
    fi
  fi
  pip=(.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile)
  "${pip[@]}" -r python/requirements-test.txt
  "${pip[@]}" --no-deps -r python/requirements-nodeps.txt
fi
