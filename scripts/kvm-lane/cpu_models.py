"""Inside the emulated host (scripts/kvm-lane/cpu_models.sh): bake the CPUID probe (cpuid.c) into a
snapshot under this boot's CPU model, and clone snapshots baked under other models, printing what
the program sees. Arguments: the probe, the shared directory, then actions `bake:NAME` (snapshot
into DIR/NAME, after printing what a fresh VM sees here) and `clone:NAME` (restore DIR/NAME).
Prints `cpu: ACTION ...` lines; exits 1 if a clone ran with other answers than its bake printed."""

from __future__ import annotations

import sys
from pathlib import Path

from collimate_core._core import Vm


def main() -> None:
    probe, shared = Path(sys.argv[1]).read_bytes(), Path(sys.argv[2])
    model = Path("/proc/cpuinfo").read_text().split("model name")[1].split("\n")[0].strip(" :\t")
    print(f"cpu: this boot's CPU: {model}")
    bad = 0
    for action in sys.argv[3:]:
        what, name = action.split(":", 1)
        if what == "bake":
            vm = Vm.boot(probe, 64 << 20)
            r = vm.run(120.0)
            assert (r.kind, r.value) == ("yield", 1), (r.kind, r.value)
            seen = r.stdout.decode().strip()
            vm.snapshot(shared / name)
            vm.destroy()
            (shared / name / "baked-saw.txt").write_text(seen.replace("boot ", "", 1))
            print(f"cpu: bake {name}: a fresh VM here sees: {seen}")
        else:
            baked = (shared / name / "baked-saw.txt").read_text()
            try:
                vm = Vm.restore(shared / name)
                r = vm.run(120.0)
                vm.destroy()
            except Exception as e:  # the engine's refusal, with what to do
                print(f"cpu: clone {name}: refused: {type(e).__name__}: {e}")
                continue
            seen = r.stdout.decode().strip()
            same = seen.replace("clone ", "", 1) == baked
            bad += not same
            print(f"cpu: clone {name}: the clone sees: {seen} ({'the same as at its bake' if same else 'NOT what its bake saw: ' + baked})")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
