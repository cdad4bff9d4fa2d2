#!/usr/bin/env bash
# Runs inside the emulated KVM host (scripts/kvm-lane/boot.sh), from /job, with /job/env written
# by scripts/kvm-lane/run.sh: the repository, the test binaries and this boot's plan.
# Prints one `lane: NAME passed=P failed=F status=S seconds=T` line per step.
set -u
. /job/env
echo "lane: host $(uname -r), kvm_amd npt=$(cat /sys/module/kvm_amd/parameters/npt 2>&1), $(nproc) cpus"
[ -c /dev/kvm ] || { echo "lane: no /dev/kvm in the emulated host"; exit 1; }
export COLLIMATE_ROOTFS COLLIMATE_CACHE=/tmp/collimate-cache COLLIMATE_REQUIRE_KVM=1 RUST_BACKTRACE=1
failed=0
step() {  # NAME COMMAND...: run it, report its pass/fail counts from libtest's summary
    local name=$1; shift
    local t0=$SECONDS log=/tmp/step-$name.log
    timeout "${LANE_STEP_TIMEOUT:-900}" "$@" > "$log" 2>&1
    local status=$?
    local passed failed_n
    passed=$(sed -n 's/^test result: .* \([0-9]*\) passed.*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
    failed_n=$(sed -n 's/^test result: .* \([0-9]*\) failed.*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
    if [ "$status" != 0 ]; then
        failed=1
        echo "---- $name (status $status):"; grep -v '^test .* ok$' "$log" | tail -n 60
    fi
    echo "lane: $name passed=$passed failed=$failed_n status=$status seconds=$((SECONDS - t0))"
}
# What upstream KVM does at an I/O exit (RIP at or past the `out`), the remedy included.
step probe "$LANE_PROBE"
for entry in $LANE_TESTS; do          # NAME=PATH[:FILTER]
    name=${entry%%=*}; rest=${entry#*=}; bin=${rest%%:*}; filter=""
    [ "$rest" != "$bin" ] && filter=${rest#*:}
    step "$name" "$bin" --test-threads=1 ${filter//+/ }
done
# The lane can see the I/O-completion bug: with the completion turned off (the fix reverted:
# COLLIMATE_TEST_NO_IO_COMPLETION, honoured for this check only), the snapshot test must fail here.
if [ -n "${LANE_CANARY:-}" ]; then
    t0=$SECONDS
    if COLLIMATE_TEST_NO_IO_COMPLETION=1 timeout 600 "$LANE_CANARY" --test-threads=1 registers_and_ymm_survive_snapshot_restore_bit_for_bit > /tmp/canary.log 2>&1; then
        failed=1; echo "lane: canary status=passed (it must fail without the I/O completion) seconds=$((SECONDS - t0))"
    else
        echo "lane: canary status=failed-as-it-must: $(grep -o 'left: .*' /tmp/canary.log | head -1) seconds=$((SECONDS - t0))"
    fi
fi
# The TLB contract's negative control: tlb.rs's stale-translation cases with the engine's
# invalidation off (COLLIMATE_TEST_NO_INVALIDATION, honoured for this check only). Under KVM's
# shadow MMU (npt=0) each must fail, saying `stale translation` (not some other assertion): the
# guest kept the old translation, so the passing run above shows the invalidation is what drops
# it. Under npt=1 QEMU flushes its whole TLB at every VMRUN/#VMEXIT, so nothing can go stale:
# reported, not required.
if [ -n "${LANE_TLB_CONTROL:-}" ]; then
    t0=$SECONDS
    cases="remap_is_seen_after_invalidate_frames unmap_faults_after_invalidate_frames
        write_protect_faults_after_invalidate_frames replaced_page_table_is_seen_after_invalidate_frames
        remap_unmap_write_protect_are_seen_after_an_exact_invalidation
        remap_unmap_write_protect_are_seen_after_one_mprotect_pair_for_the_block
        remap_unmap_write_protect_are_seen_after_flush_guest_tlb"
    COLLIMATE_TEST_NO_INVALIDATION=1 timeout 600 "$LANE_TLB_CONTROL" --test-threads=1 --exact $cases > /tmp/tlb-control.log 2>&1
    # The test names whose failure says `stale translation`.
    stale=$(awk '/^---- .* stdout ----$/ {name = $2} /stale translation/ && name != "" {print name; name = ""}' /tmp/tlb-control.log)
    n=0; seen=0; missed=""
    for c in $cases; do
        n=$((n + 1))
        if grep -qx "test $c ... FAILED" /tmp/tlb-control.log && grep -qx "$c" <<< "$stale"; then
            seen=$((seen + 1))
        else
            missed+=" $c"
        fi
    done
    if [ -n "${LANE_TLB_CONTROL_MUST_FAIL:-}" ]; then
        if [ "$seen" = "$n" ]; then
            echo "lane: tlb-control status=failed-as-it-must: $seen of $n stale-translation cases saw the stale translation without the invalidation seconds=$((SECONDS - t0))"
        else
            failed=1
            echo "lane: tlb-control status=DEFECT: without the invalidation only $seen of $n cases saw a stale translation (passed or failed otherwise:$missed) seconds=$((SECONDS - t0))"
            grep -v '^test .* ok$' /tmp/tlb-control.log | tail -n 40
        fi
    else
        echo "lane: tlb-control status=informational: $seen of $n cases saw a stale translation without the invalidation (none can here: QEMU flushes its TLB at every VMRUN/#VMEXIT) seconds=$((SECONDS - t0))"
    fi
fi
# A template baked under one CPU model replays identically under another (cpu_replay.py): baked
# in the first boot into /job/cpu-replay (run.sh carries it to the next boot), cloned in the second.
if [ -n "${LANE_CPU_REPLAY:-}" ]; then
    step cpu-replay env PATH="$LANE_PATH:$PATH" python3 "$LANE_REPO/scripts/kvm-lane/cpu_replay.py" "$LANE_CPU_REPLAY" /job/cpu-replay "$LANE_NUMPY"
    grep '^cpu-replay:' /tmp/step-cpu-replay.log
fi
if [ -n "${LANE_SMOKE:-}" ]; then
    step sdk-smoke env PATH="$LANE_PATH:$PATH" python3 "$LANE_REPO/scripts/kvm-lane/smoke.py"
    grep '^smoke:' /tmp/step-sdk-smoke.log
fi
# Per-exec event counts and the price of one event on this profile (benches/exec_events.py), on
# request (LANE_BENCH=N execs of each: it bakes the python template where the smoke did not).
if [ -n "${LANE_BENCH:-}" ]; then
    # KVM's tracepoints (CPUIDs, MMU faults, exits per exec) are read from tracefs.
    [ -d /sys/kernel/tracing/instances ] || mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
    step bench env PATH="$LANE_PATH:$PATH" python3 "$LANE_REPO/benches/exec_events.py" "$LANE_BENCH"
    grep -E '^(\||exec event|price of|where the|  )' /tmp/step-bench.log | sed 's/^/bench: /'
fi
exit $failed
