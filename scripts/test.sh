#!/usr/bin/env bash
# The test suite: set up if needed, then the engine's Rust tests (unit + KVM integration) and the
# Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh   # idempotent: installs what is missing, rebuilds the extension if needed
# The python template's root filesystem (cached; the Linux-guest tests run CPython and busybox from it).
COLLIMATE_ROOTFS=$(python3 guest/rootfs/build.py)
export COLLIMATE_ROOTFS
cargo test --release -p collimate-engine
# The slowest tests are listed at the end (where a CI run spends its time).
python3 -m pytest -q --durations=25 tests/
