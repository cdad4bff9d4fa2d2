#!/usr/bin/env bash
# Build the emulated upstream-KVM host once, in the lane's cache (never in git): Debian's QEMU,
# busybox and kernel (linux-image-amd64's current one) and an initramfs that loads kvm_amd.
# Prints the directory of this kernel and init's host (vmlinuz, initrd.gz). Idempotent: built once
# per kernel version and init; the kernel package is downloaded once per version.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
base=${COLLIMATE_KVM_LANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/collimate/kvm-lane}
mkdir -p "$base"

missing=()
command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
[ -x /bin/busybox ] || missing+=(busybox-static)
command -v cpio >/dev/null || missing+=(cpio)
command -v xz >/dev/null || missing+=(xz-utils)
if ((${#missing[@]})); then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The kernel package the metapackage points at today.
kpkg=$(apt-cache depends linux-image-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -1)
[ -n "$kpkg" ] || { echo "kvm-lane: cannot tell which kernel linux-image-amd64 depends on" >&2; exit 1; }
# One directory per kernel and init (checkouts with another init share the cache without
# rebuilding each other's): vmlinuz, initrd.gz, and what run.sh adds (the probe).
cache=$base/host-$( (echo "$kpkg"; cat "$here/init" "$here/modorder.py" "$here/host.sh") | sha256sum | cut -c1-16)
if [ -f "$cache/initrd.gz" ]; then
    echo "$cache"; exit 0
fi

# The kernel package, downloaded once per version.
kdir=$base/$kpkg
if [ ! -d "$kdir/root" ]; then
    tmp=$(mktemp -d -p "$base" kernel.XXXXXX)
    (cd "$tmp" && apt-get download -qq "$kpkg" && dpkg -x ./*.deb root && rm -f ./*.deb)
    mv -T "$tmp" "$kdir" 2>/dev/null || rm -rf "$tmp"
fi
kver=$(ls "$kdir/root/lib/modules")
build=$(mktemp -d -p "$base" host.XXXXXX)
cp "$kdir/root/boot/vmlinuz-$kver" "$build/vmlinuz"

ir=$build/initramfs
mkdir -p "$ir"/{bin,dev,proc,sys,mnt/host,mnt/rw,newroot,modules}
cp /bin/busybox "$ir/bin/busybox"
install -m 755 "$here/init" "$ir/init"
mods=$kdir/root/lib/modules/$kver/kernel
# Two lists: what the root filesystem needs (virtio, 9p, overlay), then KVM (loaded with the
# boot's npt= argument).
list() {
    local out=$1; shift
    : > "$ir/modules/$out"
    python3 "$here/modorder.py" "$mods" "$@" | while read -r path; do
        name=$(basename "$path"); name=${name%.xz}
        grep -qxF "$name" "$ir/modules/base" 2>/dev/null && continue
        grep -qxF "$name" "$ir/modules/$out" && continue
        case "$path" in *.xz) xz -dc "$path" > "$ir/modules/$name" ;; *) cp "$path" "$ir/modules/$name" ;; esac
        echo "$name" >> "$ir/modules/$out"
    done
}
list base virtio_pci 9pnet_virtio 9p overlay
list kvm kvm_amd
(cd "$ir" && find . | cpio -o -H newc --quiet | gzip -1 > "$build/initrd.gz")
rm -rf "$ir"
mv -T "$build" "$cache" 2>/dev/null || rm -rf "$build"
echo "$cache"
