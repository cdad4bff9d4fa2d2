#!/usr/bin/env bash
# Set up, then run the main job: bake a template, fork a group from it, grade the group, print the
# fork latency.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m collimate_core demo "$@"
