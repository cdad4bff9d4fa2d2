"""The low-level API (`collimate_core.Vm`) against the guest test program guest/testprogs/testvm.

The guest's mailbox protocol is described in guest/testprogs/README.md; tests/guestprogs.py holds
its constants and packers. Every test here needs /dev/kvm: without it the module is skipped
(CI fails a run that skipped them on a host that has KVM).
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collimate_core import (
    CollimateError,
    EngineError,
    RunResult,
    SnapshotError,
    Vm,
    VmDestroyedError,
)
from guestprogs import (
    CMD_EXIT,
    CMD_FAULT,
    CMD_FILL,
    CMD_HELLO,
    CMD_LOADREGS,
    CMD_SPIN,
    CMD_SUM,
    CMD_UNKNOWN_SYSCALL,
    CMD_WRITE,
    CMD_WRITE_ERR,
    ENOSYS,
    FAULT_DIV0,
    FAULT_INT3,
    FAULT_KERNEL_ADDR,
    FAULT_KERNEL_JUMP,
    FAULT_NULL_WRITE,
    FAULT_UD2,
    FAULT_VECTORS,
    GPR_ORDER,
    HEAP,
    HELLO_TEXT,
    IO_PORT,
    MAILBOX,
    MAILBOX_SIZE,
    PAGE_SIZE,
    READY_YIELD,
    REGS_IN,
    REGS_OUT,
    REGS_USED,
    RESULT_ERROR,
    NUM_YMM,
    YMM_SIZE,
    as_signed,
    heap_page,
    load_testvm,
    mailbox_result,
    pack_mailbox,
    pack_regs_in,
    unpack_regs,
)
from hostprocs import alive, describe

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

TIMEOUT = 10.0  # seconds; generous: a command takes microseconds
TEXT = range(0x400000, 0x401000)  # the guest's code page


# --- helpers -----------------------------------------------------------------------------------


def command(vm: Vm, cmd: int, arg0: int = 0, arg1: int = 0, arg2: int = 0) -> tuple[int, RunResult]:
    """Post `cmd` in the mailbox, run to the guest's `yield(cmd)`, return (result, RunResult)."""
    vm.write_mem(MAILBOX, pack_mailbox(cmd, arg0, arg1, arg2))
    r = vm.run(TIMEOUT)
    assert (r.kind, r.value) == ("yield", cmd), r
    return mailbox_result(vm.read_mem(MAILBOX, MAILBOX_SIZE)), r


def load_regs(vm: Vm, gprs: list[int], ymm: list[bytes]) -> RunResult:
    """Run LOADREGS up to its `out 0xE0, al`: the vCPU then holds exactly `gprs` and `ymm`."""
    vm.write_mem(REGS_IN, pack_regs_in(gprs, ymm))
    vm.write_mem(MAILBOX, pack_mailbox(CMD_LOADREGS))
    r = vm.run(TIMEOUT)
    assert (r.kind, r.port, r.value) == ("io", IO_PORT, gprs[0] & 0xFF), r
    return r


def finish_load_regs(vm: Vm) -> tuple[list[int], list[bytes]]:
    """Resume after LOADREGS' `out`; return what the guest stored to REGS_OUT."""
    r = vm.run(TIMEOUT)
    assert (r.kind, r.value) == ("yield", CMD_LOADREGS), r
    return unpack_regs(vm.read_mem(REGS_OUT, REGS_USED))


# kvm-bindings serializes each KVM struct as a length-prefixed byte blob; a kvm_msr_entry is
# (index u32, reserved u32, data u64). IA32_TSC (0x10) keeps counting while a VM is paused, so two
# captures of the same state differ there and nowhere else.
_TSC_ENTRY = re.compile(rb"\x10\x10\x00\x00\x00\x00\x00\x00\x00(.{8})", re.DOTALL)


def stable_state(vm: Vm) -> bytes:
    """`vcpu_state()` with the TSC value masked out."""
    state = vm.vcpu_state()
    masked, n = _TSC_ENTRY.subn(lambda m: m.group(0)[:-8] + bytes(8), state)
    assert n == 1, f"expected exactly one IA32_TSC entry in vcpu_state(), found {n}"
    return masked


def gprs_of(regs: dict) -> list[int]:
    return [regs[name] for name in GPR_ORDER]


def children_of(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return out


def vmm_processes() -> list[tuple[int, str]]:
    """(pid, state) of every VMM process (a python running `_vmm_main`) in this session, wherever
    it was reparented to."""
    found = []
    session = os.getsid(0)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"_vmm_main" not in (entry / "cmdline").read_bytes():
                continue
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        state, _ppid, _pgrp, sid = stat[stat.rindex(")") + 2 :].split()[:4]
        if int(sid) == session:
            found.append((int(entry.name), state))
    return found


def rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def fd_count(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def elf(tmp_path_factory) -> bytes:
    return load_testvm(tmp_path_factory.mktemp("testvm"))


@pytest.fixture(scope="session")
def ready_snapshot(elf, tmp_path_factory) -> Path:
    """A snapshot of testvm paused at its first `yield(0)`."""
    path = tmp_path_factory.mktemp("ready")
    with Vm.boot(elf) as vm:
        r = vm.run(TIMEOUT)
        assert (r.kind, r.value) == ("yield", READY_YIELD), r
        vm.snapshot(path)
    return path


@pytest.fixture(scope="session")
def zygote(ready_snapshot):
    """A VMM process restored from `ready_snapshot` and never run: clones start at ready."""
    with Vm.restore(ready_snapshot) as vm:
        yield vm


@pytest.fixture
def vm(zygote):
    with zygote.clone() as child:
        yield child


def copy_snapshot(src: Path, dst: Path) -> Path:
    """Copy a snapshot directory; the memory file is hard-linked (it is never written)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "vm.state", dst / "vm.state")
    try:
        os.link(src / "vm.mem", dst / "vm.mem")
    except OSError:
        shutil.copyfile(src / "vm.mem", dst / "vm.mem")
    return dst


# --- boot, run, the syscall layer --------------------------------------------------------------


def test_boot_runs_to_ready(elf):
    with Vm.boot(elf) as vm:
        assert vm.pid > 0 and alive(vm.pid)
        r = vm.run(TIMEOUT)
        assert r.kind == "yield" and r.value == READY_YIELD
        assert (r.code, r.port, r.vector, r.error_code, r.rip, r.cr2) == (None,) * 6
        assert r.stdout == b"" and r.stderr == b""
        assert 0 < r.duration < TIMEOUT and r.enosys == 0
        assert "kind='yield'" in repr(r) or 'kind="yield"' in repr(r)
        assert vm.regs()["rip"] in TEXT


def test_boot_rejects_garbage():
    with pytest.raises(EngineError, match="Vm.boot"):
        Vm.boot(b"\x7fELF but not really")


def test_fill_and_sum(vm):
    assert command(vm, CMD_FILL, 100, 7, 10)[0] == 100
    assert command(vm, CMD_SUM, 100, 0, 10)[0] == 700
    assert command(vm, CMD_SUM, 120, 0, 0)[0] == 700
    assert vm.read_mem(heap_page(10), 2) == b"\x07\x00"
    assert vm.read_mem(heap_page(9), 1) == b"\x00"
    assert vm.mem_stats()["dirty_pages"] >= 100
    # Out of the heap: refused by the guest.
    assert command(vm, CMD_FILL, 2, 1, 32767)[0] == RESULT_ERROR


def test_write_mem_is_seen_by_the_guest(vm):
    vm.write_mem(heap_page(3), b"\xfe")
    assert command(vm, CMD_SUM, 1, 0, 3)[0] == 0xFE


def test_hello_stdout(vm):
    result, r = command(vm, CMD_HELLO)
    assert result == len(HELLO_TEXT)
    assert r.stdout == HELLO_TEXT and r.stderr == b""
    # Output is per run: the next run does not repeat it.
    assert command(vm, CMD_SUM, 1)[1].stdout == b""


def test_write_and_write_err(vm):
    payload = bytes(range(256)) * 20
    vm.write_mem(heap_page(5), payload)
    result, r = command(vm, CMD_WRITE, len(payload), 0, 5)
    assert (result, r.stdout, r.stderr) == (len(payload), payload, b"")
    result, r = command(vm, CMD_WRITE_ERR, 11, 0, 5)
    assert (result, r.stdout, r.stderr) == (11, b"", payload[:11])


def test_exit_code(vm):
    vm.write_mem(MAILBOX, pack_mailbox(CMD_EXIT, 42))
    r = vm.run(TIMEOUT)
    assert (r.kind, r.code, r.value) == ("exited", 42, None), r


def test_unknown_syscall_is_enosys(vm):
    result, r = command(vm, CMD_UNKNOWN_SYSCALL, 9999)
    assert as_signed(result) == -ENOSYS and r.enosys == 1, r
    assert command(vm, CMD_UNKNOWN_SYSCALL, 39)[0] == 1  # getpid


def test_set_regs_is_a_partial_update(vm):
    before = vm.regs()
    vm.set_regs({"r12": 0xDEAD_BEEF_0000_0001, "r13": 2**64 - 1})
    after = vm.regs()
    assert after["r12"] == 0xDEAD_BEEF_0000_0001 and after["r13"] == 2**64 - 1
    assert {k: v for k, v in after.items() if k not in ("r12", "r13")} == {
        k: v for k, v in before.items() if k not in ("r12", "r13")
    }
    assert set(after) >= {*GPR_ORDER, "rsp", "rip", "rflags"}
    with pytest.raises(ValueError, match="unknown register"):
        vm.set_regs({"eax": 1})
    with pytest.raises(OverflowError):
        vm.set_regs({"rax": -1})
    # The guest keeps working (r12/r13 are not live across its loop).
    assert command(vm, CMD_SUM, 1)[0] == 0


# --- timeouts and faults -----------------------------------------------------------------------


def test_spin_is_stopped_by_the_timeout(vm):
    vm.write_mem(MAILBOX, pack_mailbox(CMD_SPIN))
    r = vm.run(0.2)
    assert r.kind == "timeout", r
    assert 0.15 < r.duration < 5.0
    # Resumable: it keeps spinning in the same place.
    r = vm.run(0.05)
    assert r.kind == "timeout", r
    assert vm.regs()["rip"] in TEXT


def test_run_releases_the_gil(vm):
    """While one thread is inside `run()`, this one keeps executing Python."""
    vm.write_mem(MAILBOX, pack_mailbox(CMD_SPIN))
    worker = threading.Thread(target=vm.run, args=(1.0,))
    stamps = []
    worker.start()
    while worker.is_alive():
        stamps.append(time.monotonic())
        time.sleep(0.01)
    worker.join()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) > 20 and max(gaps) < 0.5, f"longest stall {max(gaps):.3f}s"


def test_negative_timeout_is_refused(vm):
    with pytest.raises(ValueError, match="timeout"):
        vm.run(-1.0)


@pytest.mark.parametrize(
    "kind",
    [FAULT_UD2, FAULT_NULL_WRITE, FAULT_KERNEL_JUMP, FAULT_INT3, FAULT_DIV0],
    ids=["ud2", "null_write", "ring0_address", "int3", "div0"],
)
def test_faults_report_the_vector(vm, kind):
    vm.write_mem(MAILBOX, pack_mailbox(CMD_FAULT, kind))
    r = vm.run(TIMEOUT)
    assert r.kind == "fault", r
    assert r.vector == FAULT_VECTORS[kind], r
    assert r.error_code is not None and r.cr2 is not None
    if kind == FAULT_NULL_WRITE:
        assert r.cr2 == 0 and r.rip in TEXT
        assert r.error_code & 0b110 == 0b110, r  # a write, from user mode
    elif kind == FAULT_KERNEL_JUMP:
        assert r.cr2 == FAULT_KERNEL_ADDR and r.rip == FAULT_KERNEL_ADDR, r
    else:
        assert r.rip in TEXT, r


# --- snapshot and restore ----------------------------------------------------------------------


def _sample_regs(seed: int) -> tuple[list[int], list[bytes]]:
    gprs = [(0x0123_4567_89AB_CDEF * (i + seed + 1)) & (2**64 - 1) for i in range(len(GPR_ORDER))]
    ymm = [bytes((i * 37 + j * 11 + seed) & 0xFF for j in range(YMM_SIZE)) for i in range(NUM_YMM)]
    return gprs, ymm


def _check_roundtrip(src: Vm, snapdir: Path, gprs: list[int], ymm: list[bytes]) -> None:
    """`src` is at LOADREGS' `out`; snapshot it, restore in a fresh VMM, compare bit for bit."""
    load_regs(src, gprs, ymm)
    regs_before = src.regs()
    assert gprs_of(regs_before) == [g & (2**64 - 1) for g in gprs]
    state_before = stable_state(src)
    src.snapshot(snapdir)
    with Vm.restore(snapdir) as restored:
        assert restored.pid != src.pid
        assert restored.regs() == regs_before
        assert stable_state(restored) == state_before
        got_gprs, got_ymm = finish_load_regs(restored)
    assert got_gprs == gprs and got_ymm == ymm
    # The source is still usable after snapshot() and resumes to the same values.
    assert finish_load_regs(src) == (gprs, ymm)


def test_regs_and_ymm_survive_snapshot_restore(vm, tmp_path):
    gprs, ymm = _sample_regs(1)
    _check_roundtrip(vm, tmp_path / "snap", gprs, ymm)


def test_restore_of_a_booted_vm(elf, tmp_path):
    """A snapshot of a freshly booted VM (never run) restores and runs to ready."""
    with Vm.boot(elf) as vm:
        vm.snapshot(tmp_path)
    with Vm.restore(tmp_path) as vm:
        r = vm.run(TIMEOUT)
        assert (r.kind, r.value) == ("yield", READY_YIELD), r
        assert command(vm, CMD_HELLO)[1].stdout == HELLO_TEXT


def test_corrupted_state_is_refused(ready_snapshot, tmp_path):
    snap = copy_snapshot(ready_snapshot, tmp_path / "flip")
    data = bytearray((snap / "vm.state").read_bytes())
    data[len(data) // 2] ^= 0x40
    (snap / "vm.state").write_bytes(data)
    with pytest.raises(SnapshotError, match="damaged") as info:
        Vm.restore(snap)
    assert str(snap) in str(info.value) and "Vm.restore" in str(info.value)


def test_truncated_state_is_refused(ready_snapshot, tmp_path):
    snap = copy_snapshot(ready_snapshot, tmp_path / "short")
    data = (snap / "vm.state").read_bytes()
    (snap / "vm.state").write_bytes(data[: len(data) - 100])
    with pytest.raises(SnapshotError, match="truncated"):
        Vm.restore(snap)


def test_truncated_memory_is_refused(ready_snapshot, tmp_path):
    snap = tmp_path / "shortmem"
    snap.mkdir()
    shutil.copyfile(ready_snapshot / "vm.state", snap / "vm.state")
    with open(ready_snapshot / "vm.mem", "rb") as src, open(snap / "vm.mem", "wb") as dst:
        dst.write(src.read(1 << 20))
    with pytest.raises(SnapshotError, match="vm.mem"):
        Vm.restore(snap)


def test_foreign_version_is_refused(ready_snapshot, tmp_path):
    snap = copy_snapshot(ready_snapshot, tmp_path / "v99")
    data = bytearray((snap / "vm.state").read_bytes())
    data[8:12] = struct.pack("<I", 99)
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    (snap / "vm.state").write_bytes(data)
    with pytest.raises(SnapshotError, match="version 99"):
        Vm.restore(snap)


def test_missing_snapshot_is_refused(tmp_path):
    with pytest.raises(CollimateError, match=re.escape(str(tmp_path / "nothing"))):
        Vm.restore(tmp_path / "nothing")


# --- fork, clone, reset ------------------------------------------------------------------------


def test_fork_children_diverge_independently(vm):
    assert command(vm, CMD_FILL, 64, 0xAA, 0)[0] == 64
    state = stable_state(vm)
    kids = vm.fork(4)
    try:
        assert len(kids) == 4
        pids = {vm.pid, *(k.pid for k in kids)}
        assert len(pids) == 5
        for k in kids:
            assert stable_state(k) == state
        for i, k in enumerate(kids):
            assert command(k, CMD_FILL, 64, i + 1, 0)[0] == 64
        assert command(vm, CMD_FILL, 32, 0x55, 32)[0] == 32
        for i, k in enumerate(kids):
            assert command(k, CMD_SUM, 64, 0, 0)[0] == (i + 1) * 64
            assert k.read_mem(heap_page(0), 1) == bytes([i + 1])
            assert k.read_mem(heap_page(32), 1) == bytes([i + 1])
        assert vm.read_mem(heap_page(0), 1) == b"\xaa"
        assert vm.read_mem(heap_page(32), 1) == b"\x55"
        assert command(vm, CMD_SUM, 64, 0, 0)[0] == 32 * 0xAA + 32 * 0x55
        # A child's host-side writes stay private too.
        kids[0].write_mem(heap_page(100), b"child")
        assert vm.read_mem(heap_page(100), 5) == bytes(5)
        assert kids[1].read_mem(heap_page(100), 5) == bytes(5)
    finally:
        for k in kids:
            k.destroy()
    # The parent outlives its children.
    assert command(vm, CMD_SUM, 1, 0, 0)[0] == 0xAA


def test_clone_of_a_running_guest_continues_from_the_same_point(vm):
    gprs, ymm = _sample_regs(7)
    load_regs(vm, gprs, ymm)
    with vm.clone() as child:
        assert child.regs() == vm.regs()
        assert finish_load_regs(child) == (gprs, ymm)
    assert finish_load_regs(vm) == (gprs, ymm)


def test_reset_restores_memory_exactly(ready_snapshot):
    regions = [
        (MAILBOX, PAGE_SIZE),
        (REGS_IN, REGS_USED),
        (REGS_OUT, REGS_USED),
        (HEAP, 400 * PAGE_SIZE),
    ]
    with Vm.restore(ready_snapshot) as base, base.clone() as c:
        memory = [c.read_mem(a, n) for a, n in regions]
        regs = c.regs()
        state = stable_state(c)
        for round_ in range(2):
            assert command(c, CMD_FILL, 300, 0x5A + round_, 50)[0] == 300
            c.write_mem(HEAP + 399 * PAGE_SIZE + 17, b"scribble")
            load_regs(c, *_sample_regs(round_))
            finish_load_regs(c)
            stats = c.reset()
            assert stats["dirty_pages"] >= 301, stats
            assert 0 < stats["duration"] < 1.0
            assert [c.read_mem(a, n) for a, n in regions] == memory
            assert c.regs() == regs
            assert stable_state(c) == state
            assert c.mem_stats()["dirty_pages"] == 0
            # Back at ready: the next command runs from a clean heap.
            assert command(c, CMD_SUM, 400, 0, 0)[0] == 0
            c.reset()
        # The parent it was cloned from never saw any of it.
        assert base.read_mem(HEAP + 50 * PAGE_SIZE, 1) == b"\x00"


def test_reset_of_a_booted_vm_says_what_to_do(elf):
    with Vm.boot(elf) as vm:
        vm.run(TIMEOUT)
        with pytest.raises(EngineError, match="Vm.reset.*snapshot"):
            vm.reset()
        # The refusal leaves the VM usable.
        assert command(vm, CMD_SUM, 1)[0] == 0


def test_exceptions_share_one_base():
    for exc in (EngineError, SnapshotError, VmDestroyedError):
        assert issubclass(exc, CollimateError)
    assert issubclass(CollimateError, Exception)


def test_reset_of_a_restored_vm(ready_snapshot):
    with Vm.restore(ready_snapshot) as vm:
        command(vm, CMD_FILL, 10, 1, 0)
        assert vm.reset()["dirty_pages"] >= 10
        assert command(vm, CMD_SUM, 10, 0, 0)[0] == 0


# --- lifecycle ---------------------------------------------------------------------------------


def test_destroyed_vm_raises_a_clear_error(zygote):
    c = zygote.clone()
    pid = c.pid
    c.destroy()
    assert not alive(pid), describe(pid)
    assert repr(c) == "<Vm destroyed>"
    for call in (
        lambda: c.run(1.0),
        c.regs,
        lambda: c.read_mem(MAILBOX, 8),
        lambda: c.pid,
        c.clone,
    ):
        with pytest.raises(VmDestroyedError, match="destroyed"):
            call()
    c.destroy()  # idempotent


def test_context_manager_destroys_even_on_error(zygote):
    with pytest.raises(RuntimeError):
        with zygote.clone() as c:
            pid = c.pid
            raise RuntimeError("boom")
    assert not alive(pid), describe(pid)


def test_dropping_a_vm_kills_its_process(zygote):
    c = zygote.clone()
    pid = c.pid
    del c
    gc.collect()
    assert not alive(pid)


def test_fork_of_zero_children(vm):
    assert vm.fork(0) == []


def test_clone_destroy_cycles_leave_nothing_behind(zygote):
    def census():
        return {
            "children": len(children_of(os.getpid())),
            "zygote children": len(children_of(zygote.pid)),
            "fds": fd_count(),
            "zygote fds": fd_count(zygote.pid),
        }

    def cycles(n):
        for _ in range(n):
            c = zygote.clone()
            c.destroy()

    cycles(100)  # warm up allocators and caches
    # Other tests' clients may still be tearing their own VMM processes down in the background, so
    # the system-wide count is not compared; what matters is that no process this loop made is left.
    vmms_before = {pid for pid, _ in vmm_processes()}
    before, rss, zygote_rss = census(), rss_bytes(), rss_bytes(zygote.pid)
    cycles(1000)
    after = census()
    assert after == before
    left = [(pid, state) for pid, state in vmm_processes() if pid not in vmms_before]
    assert left == [], f"VMM processes left behind by the cycles: {left}"
    grew = rss_bytes() - rss
    zygote_grew = rss_bytes(zygote.pid) - zygote_rss
    assert grew < 8 << 20, f"test process RSS grew by {grew >> 10} KiB over 1,000 cycles"
    assert zygote_grew < 2 << 20, f"zygote RSS grew by {zygote_grew >> 10} KiB over 1,000 cycles"


def test_failed_restores_leave_nothing_behind(ready_snapshot, tmp_path):
    snap = copy_snapshot(ready_snapshot, tmp_path / "bad")
    (snap / "vm.state").write_bytes(b"CLMTSNAP" + b"\x00" * 30)
    before = (len(children_of(os.getpid())), fd_count(), len(vmm_processes()))
    for _ in range(20):
        with pytest.raises(SnapshotError):
            Vm.restore(snap)
    assert (len(children_of(os.getpid())), fd_count(), len(vmm_processes())) == before


# --- properties --------------------------------------------------------------------------------

u64s = st.integers(min_value=0, max_value=2**64 - 1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gprs=st.lists(u64s, min_size=len(GPR_ORDER), max_size=len(GPR_ORDER)),
    ymm=st.lists(
        st.binary(min_size=YMM_SIZE, max_size=YMM_SIZE), min_size=NUM_YMM, max_size=NUM_YMM
    ),
)
def test_any_registers_round_trip_through_snapshot(zygote, gprs, ymm):
    with zygote.clone() as vm, tempfile.TemporaryDirectory() as d:
        _check_roundtrip(vm, Path(d), gprs, ymm)


@pytest.fixture(scope="session")
def state_bytes(ready_snapshot) -> bytes:
    return (ready_snapshot / "vm.state").read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_damage_to_the_state_file_is_refused(
    ready_snapshot, state_bytes, tmp_path_factory, data
):
    damaged = bytearray(state_bytes)
    if data.draw(st.booleans(), label="truncate"):
        damaged = damaged[: data.draw(st.integers(0, len(state_bytes) - 1), label="length")]
    else:
        at = data.draw(st.integers(0, len(state_bytes) - 1), label="offset")
        damaged[at] ^= data.draw(st.integers(1, 255), label="xor")
    with tempfile.TemporaryDirectory(dir=tmp_path_factory.getbasetemp()) as d:
        snap = copy_snapshot(ready_snapshot, Path(d))
        (snap / "vm.state").write_bytes(damaged)
        with pytest.raises(SnapshotError):
            Vm.restore(snap)


def test_spare_pool_clones_are_identical_and_follow_the_parent(ready_snapshot):
    with Vm.restore(ready_snapshot) as z:
        with z.clone() as cold:
            reference = cold.regs()
        z.set_spare_pool(2)
        time.sleep(0.3)  # let the pool fill
        kids = z.fork(3)  # two spares and one cold fork
        try:
            for k in kids:
                assert k.regs() == reference
                assert command(k, CMD_SUM, 4, 0, 0)[0] == 0
        finally:
            for k in kids:
                k.destroy()
        z.write_mem(HEAP, b"\x07")  # changes the guest: the spares are discarded
        with z.clone() as after:
            assert after.read_mem(HEAP, 1) == b"\x07"
        with pytest.raises(EngineError):
            z.set_spare_pool(10_000)
