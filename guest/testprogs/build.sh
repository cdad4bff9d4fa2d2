#!/usr/bin/env bash
# Build the guest test program(s) into OUTDIR.
#
#   guest/testprogs/build.sh OUTDIR
#
# Produces OUTDIR/testvm (static, non-PIE x86-64 ELF, no libc).  Idempotent:
# rebuilds only when the output is missing or older than its sources, and
# installs atomically (build to a temp file, check, rename), so concurrent
# callers (parallel test processes) are safe.  Prints the output path on
# stdout; diagnostics go to stderr.  Fails loudly (non-zero exit) on any error,
# including when the fixed addresses documented in testvm.S are not where
# they must be.
set -euo pipefail

die() { echo "build.sh: error: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: $0 OUTDIR"
outdir=$1
srcdir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$srcdir/testvm.S
out=$outdir/testvm

[ -f "$src" ] || die "missing source $src"
CC=${CC:-gcc}
command -v "$CC" >/dev/null 2>&1 || die "compiler '$CC' not found (need gcc + binutils)"
command -v nm >/dev/null 2>&1 || die "nm not found (need binutils)"

mkdir -p "$outdir" || die "cannot create $outdir"

if [ -f "$out" ] && [ "$out" -nt "$src" ] && [ "$out" -nt "${BASH_SOURCE[0]}" ]; then
    echo "$out"
    exit 0
fi

tmp=$(mktemp "$outdir/.testvm.XXXXXX") || die "mktemp failed in $outdir"
trap 'rm -f "$tmp"' EXIT

"$CC" -nostdlib -static -no-pie \
    -Wl,--build-id=none \
    -Wl,-Ttext=0x400000 -Wl,-Tdata=0x600000 -Wl,-Tbss=0x1000000 \
    -o "$tmp" "$src" || die "compiling $src failed"

# Check the fixed addresses (the host side hard-codes them).
check_sym() {
    local name=$1 want=$2 got
    got=$(nm "$tmp" | awk -v n="$name" '$3 == n { print $1 }')
    [ -n "$got" ] || die "symbol $name missing in built testvm"
    [ $((16#$got)) -eq $((want)) ] || die "symbol $name at 0x$got, expected $want"
}
check_sym _start   0x400000
check_sym mailbox  0x600000
check_sym regs_in  0x601000
check_sym regs_out 0x602000
check_sym heap     0x1000000
check_sym _end     0x9000000

chmod 0755 "$tmp"
mv -f "$tmp" "$out" || die "cannot install $out"
trap - EXIT
echo "$out"
