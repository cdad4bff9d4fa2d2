#!/usr/bin/env bash
# The test suite: the engine's Rust tests (unit + KVM integration), then the Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --release -p collimate-engine
python3 -m pytest -q tests/
