#!/usr/bin/env bash
# A template baked under one CPU model and cloned under another, in the emulated kvm_amd host:
# three boots with QEMU -cpu A, B, A (default max and EPYC-v1; CPU_MODELS="A B" picks others).
# Boot 1 bakes the CPUID probe (cpuid.c) under A; boot 2 clones it under B (the engine must either
# give the clone A's CPUID answers or refuse it with what to do, never answer otherwise) and bakes
# under B; boot 3 clones B's under A. Prints what a fresh VM and each clone see; fails if a clone
# ran with other answers than its bake saw. Not part of run.sh (three more boots).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
read -r a b <<< "${CPU_MODELS:-max EPYC-v1}"
cache=$(bash scripts/kvm-lane/host.sh)
gcc -O2 -static -nostdlib -fno-pie -no-pie -fno-stack-protector -o "$cache/cpuid" scripts/kvm-lane/cpuid.c
job=$(mktemp -d -t collimate-kvm-cpu.XXXXXX)
python3 -c 'import os, site, sys
dirs = sorted({os.path.realpath(d) for d in [sys.argv[1], sys.argv[2], sys.prefix, sys.base_prefix, *site.getsitepackages()] if os.path.isdir(d)} - {"/"})
kept = []
for d in dirs:
    if not any(d.startswith(k + "/") for k in kept):
        kept.append(d)
print("\n".join(kept))' "$repo" "$cache" > "$job/shares"
py=$(python3 -c 'import sys; print(sys.executable)')
status=0
for step in "$a|bake:$a" "$b|clone:$a bake:$b" "$a|clone:$b"; do
    model=${step%%|*}; actions=${step#*|}
    printf '%s\n' "export COLLIMATE_REQUIRE_KVM=1 COLLIMATE_CACHE=/tmp/collimate-cache" \
        "'$py' '$repo/scripts/kvm-lane/cpu_models.py' '$cache/cpuid' /job $actions" > "$job/run.sh"
    echo "kvm-cpu: booting with -cpu $model: $actions"
    COLLIMATE_KVM_LANE_CPU=$model bash scripts/kvm-lane/boot.sh "$job" || status=1
done
rm -rf "$job"
exit $status
