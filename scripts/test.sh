#!/usr/bin/env bash
# The test suite: set up if needed, then the engine's Rust tests (unit + KVM integration) and the
# Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh   # idempotent: installs what is missing, rebuilds the extension if needed
cargo test --release -p collimate-engine
python3 -m pytest -q tests/
