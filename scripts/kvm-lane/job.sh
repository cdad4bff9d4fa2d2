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
if [ -n "${LANE_SMOKE:-}" ]; then
    step sdk-smoke env PATH="$LANE_PATH:$PATH" python3 "$LANE_REPO/scripts/kvm-lane/smoke.py"
    grep '^smoke:' /tmp/step-sdk-smoke.log
fi
exit $failed
