#!/usr/bin/env bash
# Boot the emulated upstream-KVM host (scripts/kvm-lane/host.sh) and run a job in it:
#   boot.sh JOB_DIR [KVM_AMD_ARGS]      e.g. boot.sh /tmp/job npt=0
# JOB_DIR/run.sh runs inside (in a chroot of this machine's / , read-only under a tmpfs overlay;
# JOB_DIR is /job there, read-write). Prints its output; exits with its status (255: no status).
# The emulated host has a /tmp of its own: each directory JOB_DIR/shares names (one absolute path
# a line: the checkout, its test binaries, the caches and the Python environment the job uses) is
# shared too, read-only, and appears at the same path inside under a tmpfs overlay (writes stay
# in the emulated host), so the job runs from any checkout, one under /tmp included.
#
# QEMU's TCG with `-cpu max` is an AMD CPU with SVM and nested paging, so kvm_amd loads inside;
# this machine's own KVM is not used. Single-threaded TCG: with multi-threaded TCG the guest
# wedged at random (no progress, not even its own timers) in binaries that passed in the boot
# before. COLLIMATE_KVM_LANE_CPU picks another -cpu model (e.g. EPYC-v4). `no_timer_check`: on a
# loaded machine the emulated timer is too slow for the kernel's IO-APIC timer check, which then
# panics at boot ("IO-APIC + timer doesn't work!", seen in one boot of the lane).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
job=$(cd "$1" && pwd); kvm_args=${2:-}
cache=$("$here/host.sh") || exit 1
rm -f "$job/status" "$job/out.log" "$job/dmesg.txt"
shares=()
if [ -f "$job/shares" ]; then
    n=0
    while IFS= read -r dir; do
        [ -n "$dir" ] || continue
        case "$dir" in /*) ;; *) echo "kvm-lane: $job/shares: $dir is not an absolute path" >&2; exit 1 ;; esac
        [ -d "$dir" ] || { echo "kvm-lane: $job/shares: no directory $dir" >&2; exit 1; }
        case "$dir" in *,*) echo "kvm-lane: $job/shares: QEMU cannot share a path with a comma: $dir" >&2; exit 1 ;; esac
        shares+=(-fsdev "local,id=s$n,path=$dir,security_model=none,readonly=on,multidevs=remap"
                 -device "virtio-9p-pci,fsdev=s$n,mount_tag=s$n")
        n=$((n + 1))
    done < "$job/shares"
fi
timeout "${COLLIMATE_KVM_LANE_TIMEOUT:-1500}" qemu-system-x86_64 \
    -machine q35 -accel tcg,thread=single,tb-size=1024 -cpu "${COLLIMATE_KVM_LANE_CPU:-max}" \
    -smp 2 -m "${COLLIMATE_KVM_LANE_MEM:-6G}" \
    -kernel "$cache/vmlinuz" -initrd "$cache/initrd.gz" \
    -append "console=ttyS0 panic=-1 loglevel=3 mitigations=off no_timer_check lane.kvm_amd=${kvm_args// /,}" \
    -nographic -no-reboot -nic none \
    -fsdev local,id=host,path=/,security_model=none,readonly=on,multidevs=remap \
    -device virtio-9p-pci,fsdev=host,mount_tag=host \
    -fsdev local,id=job,path="$job",security_model=none \
    -device virtio-9p-pci,fsdev=job,mount_tag=job \
    "${shares[@]}" \
    > "$job/console.log" 2>&1 < /dev/null
qemu=$?
[ -f "$job/out.log" ] && cat "$job/out.log"
if [ ! -f "$job/status" ]; then
    echo "kvm-lane: the emulated host ended without a status (qemu exit $qemu); its console:" >&2
    tail -n 30 "$job/console.log" >&2
    exit 255
fi
exit "$(cat "$job/status")"
