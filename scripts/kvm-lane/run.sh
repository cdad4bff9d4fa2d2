#!/usr/bin/env bash
# The upstream-KVM lane: the engine on kvm_amd, by emulation, with nested paging and with KVM's
# shadow MMU. Builds the emulated host (host.sh: Debian's qemu-system-x86, busybox-static, cpio
# and linux-image-amd64, in the cache), builds the engine's KVM integration test binaries here,
# boots the host twice under single-threaded TCG (kvm_amd npt=0 under QEMU's EPYC-v1 CPU, then
# npt=1 under max) and runs a plan of tests, the SDK smoke (smoke.py) and the CPU-model replay
# (cpu_replay.py: baked in the first boot, cloned in the second) inside. Fails on any failure;
# prints the pass counts per boot and the lane's duration.
#
#   bash scripts/kvm-lane/run.sh            # both boots
#   LANE_MODES="npt=0" bash scripts/kvm-lane/run.sh   # one boot (no CPU-model replay)
#   LANE_CPUS="EPYC-v4 max" bash scripts/kvm-lane/run.sh  # other QEMU models, one per boot
#   LANE_TESTS="a=$PWD/target/release/deps/linux_replay-HASH:vdso_reads b=..." bash scripts/kvm-lane/run.sh
#   LANE_TESTS=" " bash scripts/kvm-lane/run.sh   # no tests: the probe and the CPU-model replay
#   LANE_BENCH=5 bash scripts/kvm-lane/run.sh   # also benches/exec_events.py, 5 execs of each
#
# Every KVM test file of the engine runs in both boots (see docs/platforms.md for what each step
# shows and what the lane costs: under TCG everything runs 10-60x slower than here and an exit
# costs 2-3 ms; the lane must stay under 25 minutes on a 2-core machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
start=$SECONDS
# The boots, in order, and the QEMU CPU model of each (LANE_CPUS, one per mode): two models, so
# that a template baked in the first boot (under the smaller model: a template asks its clone's
# host for every feature its baking host had) is cloned in the second under another
# (cpu_replay.py). npt=0 needs no NPT of the model; npt=1 runs under max, whose NPT QEMU's TCG
# emulates.
modes=${LANE_MODES:-npt=0 npt=1}
cpus=${LANE_CPUS:-EPYC-v1 max}

cache=$(bash scripts/kvm-lane/host.sh)
export COLLIMATE_ROOTFS=${COLLIMATE_ROOTFS:-$(python3 guest/rootfs/build.py)}
deb_cache=${COLLIMATE_DEB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/collimate/debs}

# The test binaries, built on this machine (nothing new to build when the suite ran before).
build_log=$(mktemp)
if ! artifacts=$(cargo test --release -p collimate-engine --no-run --message-format=json 2>"$build_log"); then
    echo "kvm-lane: building the engine's test binaries failed:" >&2; tail -n 40 "$build_log" >&2; rm -f "$build_log"; exit 1
fi
rm -f "$build_log"
bin() {
    python3 -c '
import json, sys
for line in sys.stdin:
    a = json.loads(line)
    t = a.get("target", {})
    if a.get("reason") == "compiler-artifact" and t.get("kind") == ["test"] and t.get("name") == sys.argv[1] and a.get("executable"):
        print(a["executable"]); break
else:
    sys.exit("kvm-lane: no test binary " + sys.argv[1])' "$1" <<< "$artifacts"
}
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
gcc -O2 -Wall -o "$cache/probe" scripts/kvm-lane/probe.c
# numpy's wheel for the CPU-model replay (an input, downloaded once, like the kernel).
numpy_dir=$(python3 scripts/kvm-lane/cpu_replay.py numpy "$(dirname "$cache")/wheels")

# What the emulated host must see besides its / (boot.sh: it has a /tmp of its own, where CI
# clones): the checkout, the test binaries (and the tests' CARGO_TARGET_TMPDIR), the lane's
# cache, the root filesystem, the Debian packages, and the Python environment (the venv and the
# interpreter it points at; an editable install points into the checkout). Each at its own path;
# one under another is covered by it.
venv=${VIRTUAL_ENV:-}
share_list() {
    {
        printf '%s\n' "$repo" "$target" "$cache" "$COLLIMATE_ROOTFS" "$deb_cache" "$numpy_dir"
        [ -n "$venv" ] && printf '%s\n' "$venv"
        python3 -c 'import site, sys; print(sys.prefix); print(sys.base_prefix); print(*site.getsitepackages(), sep="\n")'
    } | python3 -c '
import os, sys
dirs = sorted({os.path.realpath(d) for d in sys.stdin.read().split("\n") if d and os.path.isdir(d)} - {"/"})
kept = []
for d in dirs:
    if not any(d.startswith(k + "/") for k in kept):
        kept.append(d)
print("\n".join(kept))'
}

# The plan, per boot: NAME=BINARY[:FILTER+FILTER...]. Every KVM test file of the engine, in both
# boots (the systrap ones need no KVM). LANE_TESTS (same form) replaces the plan in every boot,
# without the canaries and the SDK smoke.
plan=""
for t in vm tlb flush_contract linux_replay linux_snapshot linux jail cpu_template linux_files linux_proc linux_shared leak; do
    plan+="$t=$(bin "$t") "
done

status=0
summary=""
read -r -a cpu_list <<< "$cpus"
# The CPU-model replay (cpu_replay.py): baked in the first boot, cloned in the second; the
# template goes from one boot's job directory to the next one's through $carry.
carry=$(mktemp -d -t collimate-kvm-carry.XXXXXX)
replay=bake
n_modes=$(wc -w <<< "$modes")
i=0
for mode in $modes; do
    cpu=${cpu_list[$i]:-max}; i=$((i + 1))
    job=$(mktemp -d -t collimate-kvm-lane.XXXXXX)
    cpu_replay=""
    if [ "$n_modes" -ge 2 ] && [ "$replay" != done ]; then
        cpu_replay=$replay
        # (none if the bake failed: the clone step then fails saying so)
        [ "$replay" != clone ] || cp -a "$carry/cpu-replay" "$job/cpu-replay" 2>/dev/null || true
    fi
    # The TLB control (job.sh) must see stale translations under KVM's shadow MMU (npt=0); under
    # npt=1 it cannot (QEMU flushes its whole TLB at every VMRUN/#VMEXIT) and is reported only.
    tests=$plan; smoke=""; canary=""; tlb_control=$(bin tlb); tlb_control_must_fail=1
    if [ "$mode" = npt=1 ]; then smoke=1; canary=$(bin vm); tlb_control_must_fail=""; fi
    if [ -n "${LANE_TESTS:-}" ]; then tests=$LANE_TESTS; smoke=""; canary=""; tlb_control=""; fi
    share_list > "$job/shares"
    {
        echo "COLLIMATE_ROOTFS='$COLLIMATE_ROOTFS'"
        echo "COLLIMATE_DEB_CACHE='$deb_cache'"
        echo "LANE_REPO='$repo' LANE_PROBE='$cache/probe'"
        echo "LANE_TESTS='$tests' LANE_SMOKE='$smoke' LANE_CANARY='$canary'"
        echo "LANE_TLB_CONTROL='$tlb_control' LANE_TLB_CONTROL_MUST_FAIL='$tlb_control_must_fail'"
        echo "LANE_BENCH='${LANE_BENCH:-}'"
        echo "LANE_CPU_REPLAY='$cpu_replay' LANE_NUMPY='$numpy_dir'"
        # The interpreter that runs here (a venv's own bin: its python3 links to the base one).
        echo "LANE_PATH='$(dirname "$(python3 -c 'import sys; print(sys.executable)')")'"
    } > "$job/env"
    cp scripts/kvm-lane/job.sh "$job/run.sh"
    boot_start=$SECONDS
    echo "kvm-lane: booting the emulated kvm_amd host ($cpu) with $mode (load $(cut -d' ' -f1-3 /proc/loadavg)); sharing: $(tr '\n' ' ' < "$job/shares")"
    set +e
    COLLIMATE_KVM_LANE_CPU=$cpu bash scripts/kvm-lane/boot.sh "$job" "$mode" | tee "$job/lane.log"
    rc=${PIPESTATUS[0]}
    set -e
    case "$cpu_replay" in
        bake) rm -rf "$carry/cpu-replay"; cp -a "$job/cpu-replay" "$carry/cpu-replay" 2>/dev/null || true; replay=clone ;;
        clone) replay=done ;;
    esac
    [ "$rc" = 0 ] || status=1
    counts=$(awk '/^lane: .* passed=/{for(i=3;i<=NF;i++) if($i ~ /^passed=/){split($i,a,"=");p+=a[2]} else if($i ~ /^failed=/){split($i,b,"=");f+=b[2]}} END {printf "%d passed, %d failed", p, f}' "$job/lane.log")
    summary+="kvm-lane: kvm_amd $mode ($cpu): $counts, status $rc, $((SECONDS - boot_start)) s (load after: $(cut -d' ' -f1-3 /proc/loadavg))"$'\n'
    [ "$rc" = 0 ] && rm -rf "$job" || echo "kvm-lane: the boot's files are kept in $job"
done
rm -rf "$carry"
printf '%s' "$summary"
echo "kvm-lane: $((SECONDS - start)) s in all"
exit $status
