#!/usr/bin/env bash
# Boot the emulated upstream-KVM host (scripts/kvm-lane/host.sh) and run a job in it:
#   boot.sh JOB_DIR [KVM_AMD_ARGS]      e.g. boot.sh /tmp/job npt=0
# JOB_DIR/run.sh runs inside (in a chroot of this machine's / , read-only under a tmpfs overlay;
# JOB_DIR is /job there, read-write). Prints its output; exits with its status (255: no status).
#
# QEMU's TCG with `-cpu max` is an AMD CPU with SVM and nested paging, so kvm_amd loads inside;
# this machine's own KVM is not used. Single-threaded TCG: with multi-threaded TCG the guest
# wedged at random (no progress, not even its own timers) in binaries that passed in the boot
# before. COLLIMATE_KVM_LANE_CPU picks another -cpu model (e.g. EPYC-v4).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
job=$(cd "$1" && pwd); kvm_args=${2:-}
cache=$("$here/host.sh") || exit 1
rm -f "$job/status" "$job/out.log" "$job/dmesg.txt"
timeout "${COLLIMATE_KVM_LANE_TIMEOUT:-1500}" qemu-system-x86_64 \
    -machine q35 -accel tcg,thread=single,tb-size=1024 -cpu "${COLLIMATE_KVM_LANE_CPU:-max}" \
    -smp 2 -m "${COLLIMATE_KVM_LANE_MEM:-6G}" \
    -kernel "$cache/vmlinuz" -initrd "$cache/initrd.gz" \
    -append "console=ttyS0 panic=-1 loglevel=3 mitigations=off lane.kvm_amd=${kvm_args// /,}" \
    -nographic -no-reboot -nic none \
    -fsdev local,id=host,path=/,security_model=none,readonly=on,multidevs=remap \
    -device virtio-9p-pci,fsdev=host,mount_tag=host \
    -fsdev local,id=job,path="$job",security_model=none \
    -device virtio-9p-pci,fsdev=job,mount_tag=job \
    > "$job/console.log" 2>&1 < /dev/null
qemu=$?
[ -f "$job/out.log" ] && cat "$job/out.log"
if [ ! -f "$job/status" ]; then
    echo "kvm-lane: the emulated host ended without a status (qemu exit $qemu); its console:" >&2
    tail -n 30 "$job/console.log" >&2
    exit 255
fi
exit "$(cat "$job/status")"
