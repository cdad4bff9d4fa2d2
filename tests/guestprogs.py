"""Build and drive the guest test program ``guest/testprogs/testvm``.

Pure stdlib.  See ``guest/testprogs/README.md`` for the mailbox protocol.

Typical use from a test::

    from guestprogs import load_testvm, pack_mailbox, MAILBOX, CMD_FILL

    elf = load_testvm(tmp_path_factory.getbasetemp())
    vm = ...boot(elf)...
    assert vm.run(...) yields 0                  # "ready"
    vm.write_mem(MAILBOX, pack_mailbox(CMD_FILL, 10, 0xAB, 0))
    assert vm.run(...) yields CMD_FILL
"""

from __future__ import annotations

import os
import struct
import subprocess
import threading
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTPROGS_DIR = REPO_ROOT / "guest" / "testprogs"
BUILD_SH = TESTPROGS_DIR / "build.sh"

# --- fixed guest addresses (must match guest/testprogs/testvm.S) -------------
ENTRY = 0x400000
MAILBOX = 0x600000
MAILBOX_SIZE = 5 * 8
MAILBOX_CMD = MAILBOX + 0
MAILBOX_ARG0 = MAILBOX + 8
MAILBOX_ARG1 = MAILBOX + 16
MAILBOX_ARG2 = MAILBOX + 24
MAILBOX_RESULT = MAILBOX + 32
REGS_IN = 0x601000
REGS_OUT = 0x602000
REGS_SIZE = 4096
HEAP = 0x1000000
PAGE_SIZE = 4096
HEAP_PAGES = 32768
HEAP_SIZE = HEAP_PAGES * PAGE_SIZE  # 128 MiB

# regs_in / regs_out layout
GPR_ORDER = (
    "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp",
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15",
)
NUM_GPRS = len(GPR_ORDER)  # 15, rsp is not loaded
REGS_RSP_OFFSET = 120  # regs_out only, informational
REGS_RFLAGS_OFFSET = 128  # regs_out only, informational
REGS_YMM_OFFSET = 256
NUM_YMM = 16
YMM_SIZE = 32
REGS_USED = REGS_YMM_OFFSET + NUM_YMM * YMM_SIZE  # 768

# --- protocol ---------------------------------------------------------------
READY_YIELD = 0  # value of the very first yield
IO_PORT = 0xE0  # LOADREGS: `out 0xE0, al`
YIELD_NR = 0x4000_0000
ENOSYS = 38

CMD_FILL = 1
CMD_SUM = 2
CMD_SPIN = 3
CMD_LOADREGS = 4
CMD_WRITE = 5
CMD_WRITE_ERR = 6
CMD_FAULT = 7
CMD_EXIT = 8
CMD_UNKNOWN_SYSCALL = 9
CMD_HELLO = 10

RESULT_ERROR = 0xFFFF_FFFF_FFFF_FFFF  # -1: unknown command / bad range / bad fault kind

HELLO_TEXT = b"hello from the guest\n"

# CMD_FAULT kinds (arg0) and the exception vector each should produce.
FAULT_UD2 = 0
FAULT_NULL_WRITE = 1
FAULT_KERNEL_JUMP = 2
FAULT_INT3 = 3
FAULT_DIV0 = 4
FAULT_KERNEL_ADDR = 0xFFFF_FF80_0000_0000
FAULT_VECTORS = {
    FAULT_UD2: 6,  # #UD
    FAULT_NULL_WRITE: 14,  # #PF, cr2 = 0
    FAULT_KERNEL_JUMP: 14,  # #PF, cr2 = rip = FAULT_KERNEL_ADDR
    FAULT_INT3: 3,  # #BP (needs a DPL-3 IDT gate)
    FAULT_DIV0: 0,  # #DE
}

_MAILBOX_FMT = "<5Q"
_U64 = (1 << 64) - 1


# --- build ------------------------------------------------------------------
_build_lock = threading.Lock()
_built: Optional[Path] = None


def build_testvm(tmpdir: os.PathLike | str) -> Path:
    """Build ``testvm`` into ``tmpdir`` (once per process) and return its path.

    Later calls return the first build's path whatever ``tmpdir`` they pass.
    Raises ``RuntimeError`` (with the build output) if the build fails.
    """
    global _built
    with _build_lock:
        if _built is not None and _built.is_file():
            return _built
        outdir = Path(tmpdir)
        proc = subprocess.run(
            ["bash", str(BUILD_SH), str(outdir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{BUILD_SH} {outdir} failed (exit {proc.returncode}):\n"
                f"{proc.stdout}{proc.stderr}"
            )
        path = outdir / "testvm"
        if not path.is_file():
            raise RuntimeError(f"{BUILD_SH} succeeded but {path} is missing")
        _built = path
        return path


def load_testvm(tmpdir: os.PathLike | str) -> bytes:
    """The bytes of ``build_testvm(tmpdir)``.

    (Deliberately not named ``test*``: pytest would collect it when imported.)
    """
    return build_testvm(tmpdir).read_bytes()


# --- mailbox / register helpers ----------------------------------------------
def u64(x: int) -> int:
    """Wrap a (possibly negative) int to u64."""
    return x & _U64


def as_signed(x: int) -> int:
    """Interpret a u64 as i64 (e.g. a syscall result: -38 for ENOSYS)."""
    x &= _U64
    return x - (1 << 64) if x >> 63 else x


def pack_mailbox(cmd: int, arg0: int = 0, arg1: int = 0, arg2: int = 0, result: int = 0) -> bytes:
    """40 bytes to write at ``MAILBOX``.  Negative values are wrapped to u64."""
    return struct.pack(_MAILBOX_FMT, u64(cmd), u64(arg0), u64(arg1), u64(arg2), u64(result))


def unpack_mailbox(data: bytes) -> tuple[int, int, int, int, int]:
    """(cmd, arg0, arg1, arg2, result) from ``read_mem(MAILBOX, MAILBOX_SIZE)``."""
    return struct.unpack(_MAILBOX_FMT, bytes(data[:MAILBOX_SIZE]))


def mailbox_result(data: bytes) -> int:
    """The ``result`` field (u64) of a mailbox read with ``read_mem(MAILBOX, MAILBOX_SIZE)``."""
    return unpack_mailbox(data)[4]


def heap_page(page: int) -> int:
    """Guest address of heap page ``page``."""
    return HEAP + page * PAGE_SIZE


def pack_regs_in(gprs: Sequence[int], ymm: Sequence[bytes] = ()) -> bytes:
    """``REGS_USED`` (768) bytes to write at ``REGS_IN`` for CMD_LOADREGS.

    ``gprs``: 15 values in ``GPR_ORDER``.  ``ymm``: up to 16 values of 32 bytes
    (missing ones are zero).
    """
    if len(gprs) != NUM_GPRS:
        raise ValueError(f"need {NUM_GPRS} GPR values ({', '.join(GPR_ORDER)}), got {len(gprs)}")
    if len(ymm) > NUM_YMM:
        raise ValueError(f"at most {NUM_YMM} ymm values")
    buf = bytearray(REGS_USED)
    struct.pack_into(f"<{NUM_GPRS}Q", buf, 0, *(u64(v) for v in gprs))
    for i, v in enumerate(ymm):
        v = bytes(v)
        if len(v) != YMM_SIZE:
            raise ValueError(f"ymm{i}: need {YMM_SIZE} bytes, got {len(v)}")
        off = REGS_YMM_OFFSET + i * YMM_SIZE
        buf[off : off + YMM_SIZE] = v
    return bytes(buf)


def unpack_regs(data: bytes) -> tuple[list[int], list[bytes]]:
    """(gprs in ``GPR_ORDER``, [ymm0..ymm15]) from ``read_mem(REGS_OUT, REGS_USED)``."""
    data = bytes(data)
    if len(data) < REGS_USED:
        raise ValueError(f"need at least {REGS_USED} bytes, got {len(data)}")
    gprs = list(struct.unpack_from(f"<{NUM_GPRS}Q", data, 0))
    ymm = [
        data[REGS_YMM_OFFSET + i * YMM_SIZE : REGS_YMM_OFFSET + (i + 1) * YMM_SIZE]
        for i in range(NUM_YMM)
    ]
    return gprs, ymm


def regs_out_rsp_rflags(data: bytes) -> tuple[int, int]:
    """(rsp, rflags) the guest saw when storing ``regs_out`` (informational)."""
    return struct.unpack_from("<2Q", bytes(data), REGS_RSP_OFFSET)
