#!/usr/bin/env bash
# The upstream-KVM lane: the engine on kvm_amd, by emulation, with nested paging and with KVM's
# shadow MMU. Builds the emulated host (host.sh: Debian's qemu-system-x86, busybox-static, cpio
# and linux-image-amd64, in the cache), builds the engine's KVM integration test binaries here,
# boots the host twice under single-threaded TCG (kvm_amd npt=1, then npt=0) and runs a plan of
# tests and the SDK smoke (smoke.py) inside. Fails on any failure; prints the pass counts per boot
# and the lane's duration.
#
#   bash scripts/kvm-lane/run.sh            # both boots
#   LANE_MODES="npt=0" bash scripts/kvm-lane/run.sh
#
# Not the whole engine suite: under TCG everything runs 5-20x slower than here and an exit costs
# 2-3 ms, and the lane must stay under 25 minutes on a 2-core machine. The plan below covers every
# mechanism that depends on the host's KVM (see docs/platforms.md for what each step shows):
# vCPU state capture/restore, snapshot, clone, fork and reset at I/O exits (vm.rs, all of it),
# guest page-table edits and their invalidation (tlb.rs, all of it: with npt=0 its stale-
# translation cases are the shadow MMU's), Linux programs through snapshot/fork/reset
# (linux_snapshot.rs), the flush each profile owes after a narrowing edit (flush_contract.rs),
# replay and the virtual clock across fork, restore and reset (linux_replay.rs), the jail
# (jail.rs), and the SDK. Left out: linux.rs, linux_files.rs, linux_proc.rs and leak.rs (the same
# KVM paths as linux_snapshot.rs, 4-5 minutes more per boot), and linux_shared.rs, one of whose
# tests gives Python 5 s of wall-clock time to start (it takes longer under TCG).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
start=$SECONDS
modes=${LANE_MODES:-npt=1 npt=0}

cache=$(bash scripts/kvm-lane/host.sh)
export COLLIMATE_ROOTFS=${COLLIMATE_ROOTFS:-$(python3 guest/rootfs/build.py)}

# The test binaries, built on this machine (the emulated host sees the same paths).
artifacts=$(cargo test --release -p collimate-engine --no-run --message-format=json 2>/dev/null)
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
gcc -O2 -Wall -o "$cache/probe" scripts/kvm-lane/probe.c

# The plan, per boot: NAME=BINARY[:FILTER+FILTER...]. Both boots run everything that depends on
# the paging mode; the boot with nested paging also runs the Linux and SDK steps (they take the
# same KVM paths with either mode, and the lane's time is bounded).
common="vm=$(bin vm) tlb=$(bin tlb) flush_contract=$(bin flush_contract) linux_snapshot=$(bin linux_snapshot)"
# linux_replay's vdso_reads_and_syscall_reads_share_the_virtual_clock is left out: in this lane a
# restored zygote and its clone (or a fork and its parent) read the virtual clock one quantum
# apart at a new thread's first vDSO read, in most boots (docs/platforms.md, "Known failures").
npt1_extra="linux_replay=$(bin linux_replay):--skip+vdso_reads_and_syscall_reads_share_the_virtual_clock jail=$(bin jail)"

status=0
summary=""
for mode in $modes; do
    job=$(mktemp -d -t collimate-kvm-lane.XXXXXX)
    tests=$common; smoke=""; canary=""
    if [ "$mode" = npt=1 ]; then tests="$common $npt1_extra"; smoke=1; canary=$(bin vm); fi
    {
        echo "COLLIMATE_ROOTFS='$COLLIMATE_ROOTFS'"
        echo "COLLIMATE_DEB_CACHE='${COLLIMATE_DEB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/collimate/debs}'"
        echo "LANE_REPO='$repo' LANE_PROBE='$cache/probe' LANE_VENV='$(dirname "$(dirname "$(readlink -f "$(command -v python3)")")")'"
        echo "LANE_TESTS='$tests' LANE_SMOKE='$smoke' LANE_CANARY='$canary'"
        # The venv's python3 is a symlink to the base interpreter: the venv's own bin first.
        [ -n "${VIRTUAL_ENV:-}" ] && echo "LANE_VENV='$VIRTUAL_ENV'"
    } > "$job/env"
    cp scripts/kvm-lane/job.sh "$job/run.sh"
    boot_start=$SECONDS
    echo "kvm-lane: booting the emulated kvm_amd host with $mode"
    set +e
    bash scripts/kvm-lane/boot.sh "$job" "$mode" | tee "$job/lane.log"
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" = 0 ] || status=1
    counts=$(awk '/^lane: .* passed=/{for(i=3;i<=NF;i++) if($i ~ /^passed=/){split($i,a,"=");p+=a[2]} else if($i ~ /^failed=/){split($i,b,"=");f+=b[2]}} END {printf "%d passed, %d failed", p, f}' "$job/lane.log")
    summary+="kvm-lane: kvm_amd $mode: $counts, status $rc, $((SECONDS - boot_start)) s"$'\n'
    [ "$rc" = 0 ] && rm -rf "$job" || echo "kvm-lane: the boot's files are kept in $job"
done
printf '%s' "$summary"
echo "kvm-lane: $((SECONDS - start)) s in all"
exit $status
