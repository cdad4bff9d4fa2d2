"""A template baked under one CPU model replays identically in a clone on a host of another model.

Runs inside the emulated kvm_amd host (scripts/kvm-lane/job.sh), in the lane's two boots, which
QEMU runs under two CPU models (run.sh): `bake DIR NUMPY` in the first, `clone DIR NUMPY` in the
second, DIR carried from one boot to the other (run.sh copies it). On the host, `numpy WHEELS`\nprints the directory of numpy's wheel, downloaded and unpacked there once.

The program is Debian's python3 with numpy's wheel from PyPI (unpacked on the host, mounted at
/work). Before the template's pause it prints its CPUID leaves (the feature leaves a program
dispatches on, read with the `cpuid` instruction itself); after it, in a clone reseeded with
SEED, it prints them again, imports numpy and prints the SIMD extensions numpy's dispatch found
(`np.show_runtime()` and `__cpu_features__`), then seeded draws (os.urandom, random, uuid4).

- bake: the template is baked here (its CPU template is this host's), then cloned once here; the
  clone's output is the reference (DIR/bake.json).
- clone: the template is cloned on this other host; its output must equal the reference byte for
  byte, and a fresh VM here must see other CPUID leaves than the template's (this host does
  differ: else the step shows nothing and fails).

Prints `cpu-replay: ...` lines; exits 1 on a difference.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from collimate_core._core import Vm

SEED = bytes(range(32))

PROGRAM = r"""
import ctypes, mmap, sys
# push rbx; mov r8, rdx; mov eax, edi; mov ecx, esi; cpuid; mov [r8..+12], eax..edx; pop rbx; ret
CODE = bytes.fromhex("534989d089f889f10fa24189004189580441894808418950" "0c5bc3")
buf = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(CODE)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
cpuid = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32))(addr)

def leaves():
    out = []
    for leaf, sub, regs in [(0, 0, "abcd"), (1, 0, "acd"), (7, 0, "bcd"), (0xd, 0, "ac"), (0x80000001, 0, "cd")]:
        r = (ctypes.c_uint32 * 4)()
        cpuid(leaf, sub, r)
        vals = dict(zip("abcd", r))
        if leaf == 1:
            vals["c"] &= ~(1 << 27)  # OSXSAVE follows the guest's CR4
        out.append(f"{leaf:#x}.{sub}:" + ",".join(f"e{x}x={vals[x]:08x}" for x in regs))
    return " ".join(out)

print("before", leaves(), flush=True)
ctypes.CDLL(None).syscall(0x40000000, 7)  # the template's pause
print("after", leaves())
import io, contextlib
import numpy as np
from numpy.core._multiarray_umath import __cpu_baseline__, __cpu_dispatch__, __cpu_features__
text = io.StringIO()
with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
    np.show_runtime()
simd = [l.strip() for l in text.getvalue().splitlines() if l.strip().startswith(("'found'", "'not_found'", "'baseline'", "'SSE", "'AVX", "'FMA", "'F16C", "'POPCNT"))]
print("numpy show_runtime", " ".join(simd))
print("numpy found", ",".join(sorted(f for f in __cpu_dispatch__ if __cpu_features__[f])))
print("numpy baseline", ",".join(__cpu_baseline__))
import os, random, uuid
print("draws", os.urandom(16).hex(), random.random(), uuid.uuid4(), float(np.random.default_rng().random()))
"""


def model() -> str:
    return Path("/proc/cpuinfo").read_text().split("model name")[1].split("\n")[0].strip(" :\t")


def fresh(rootfs: str, numpy: str) -> str:
    """What a fresh VM on this host sees before the pause (the leaves line)."""
    with Vm.spawn(rootfs, ["/usr/bin/python3", "-c", PROGRAM], env={"PYTHONPATH": "/work"}, ro_mounts={"/work": numpy}) as vm:
        r = vm.run(600.0)
        if (r.kind, r.value) != ("yield", 7):
            sys.exit(f"cpu-replay: the program did not reach its pause: {r.kind} {r.code} {r.stderr.decode(errors='replace')[-2000:]}")
        return r.stdout.decode().strip()


def clone(snap: Path) -> str:
    """A clone of the template, reseeded with SEED (replay mode), run to its end: its output."""
    with Vm.restore(snap) as vm:
        vm.reseed(SEED)
        r = vm.run(600.0)
        if (r.kind, r.code) != ("exited", 0):
            sys.exit(f"cpu-replay: the clone failed: {r.kind} {r.code} {r.signal} {r.stderr.decode(errors='replace')[-2000:]}")
        return r.stdout.decode()


NUMPY = "numpy==1.26.4"  # as tests/test_cpus.py: a cp311 manylinux2014 wheel for Debian's python3


def numpy_dir(wheels: Path) -> Path:
    """numpy's wheel from PyPI, downloaded once into `wheels` and unpacked there (on the host)."""
    import subprocess
    import zipfile

    dest = wheels / "numpy-1.26.4-cp311"
    if (dest / "numpy" / "__init__.py").exists():
        return dest
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("numpy-1.26.4-cp311-cp311-manylinux*_x86_64.whl"))
    if not found:
        subprocess.run(["/usr/bin/python3", "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                        "--platform", "manylinux2014_x86_64", "-d", str(wheels), NUMPY], check=True, stdout=sys.stderr)
        found = sorted(wheels.glob("numpy-1.26.4-cp311-cp311-manylinux*_x86_64.whl"))
    tmp = wheels / f".unpack-{os.getpid()}"
    with zipfile.ZipFile(found[-1]) as z:
        z.extractall(tmp)
    for p in tmp.rglob("*.so*"):
        p.chmod(0o755)
    try:
        tmp.rename(dest)
    except OSError:  # another process unpacked it first
        pass
    return dest


def main() -> None:
    if sys.argv[1] == "numpy":  # on the host: `numpy WHEELS_DIR` prints the unpacked wheel's directory
        print(numpy_dir(Path(sys.argv[2])))
        return
    what, shared, numpy = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    rootfs = os.environ["COLLIMATE_ROOTFS"]
    here = model()
    snap = shared / "template"
    if what == "bake":
        shared.mkdir(parents=True, exist_ok=True)
        with Vm.spawn(rootfs, ["/usr/bin/python3", "-c", PROGRAM], env={"PYTHONPATH": "/work"}, ro_mounts={"/work": numpy}) as vm:
            r = vm.run(600.0)
            if (r.kind, r.value) != ("yield", 7):
                sys.exit(f"cpu-replay: the program did not reach its pause: {r.kind} {r.code} {r.stderr.decode(errors='replace')[-2000:]}")
            before = r.stdout.decode().strip()
            vm.snapshot(snap)
        out = clone(snap)
        (shared / "bake.json").write_text(json.dumps({"model": here, "before": before, "clone": out}))
        print(f"cpu-replay: baked under {here}: {before}")
        for line in out.splitlines():
            print(f"cpu-replay: its clone here: {line}")
        after = next(l for l in out.splitlines() if l.startswith("after "))
        if after.split(" ", 1)[1] != before.split(" ", 1)[1]:
            print("cpu-replay: FAILED: the clone's CPUID leaves differ from the bake's")
            sys.exit(1)
        return
    ref = json.loads((shared / "bake.json").read_text())
    out = clone(snap)
    mine = fresh(rootfs, numpy)
    print(f"cpu-replay: this host: {here}; the template was baked under {ref['model']}")
    print(f"cpu-replay: a fresh VM here sees: {mine}")
    print(f"cpu-replay: the template's bake saw: {ref['before']}")
    for line in out.splitlines():
        print(f"cpu-replay: the clone here: {line}")
    bad = False
    if out != ref["clone"]:
        bad = True
        print("cpu-replay: FAILED: the clone's output differs from the clone's on the baking host:")
        for a, b in zip(ref["clone"].splitlines(), out.splitlines()):
            if a != b:
                print(f"cpu-replay:   baking host: {a}\ncpu-replay:   this host:   {b}")
    if mine.split(" ", 1)[1] == ref["before"].split(" ", 1)[1]:
        bad = True
        print("cpu-replay: FAILED: a fresh VM here sees the template's CPUID leaves: the two hosts do not differ, this shows nothing")
    if not bad:
        print("cpu-replay: identical: CPUID leaves, numpy's SIMD dispatch and the seeded draws, on a host whose fresh VMs see other leaves")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
