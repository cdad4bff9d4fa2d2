"""Results of execs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExecResult:
    """What one exec did.

    `ok` is True when the program ran to completion with exit code 0 within its time budget.
    `seed` is always the seed the guest CRNG was pinned with (drawn fresh when none was given), so
    any result can be replayed; `seed_ack` is the verdict of the seed-ack handshake: "verified",
    "no-ack", "off", "mismatch" or "not-reproducible" (see docs/replay.md). `host` says where it ran: the Ray node id
    on a Ray client, None on one host.

    The sandbox's Python interpreter (the in-guest agent, guest pid 1) keeps its state from one
    exec to the next. When an exec ends it (os._exit, a fatal signal such as
    `os.kill(os.getpid(), 9)`, a crash), that exec's result has `interpreter_died` set, and the
    sandbox is restored from its template before its next exec, which has `interpreter_restarted`
    set: it runs in a fresh interpreter, and everything earlier execs left (variables, imports,
    processes, files in /tmp and /work) is gone.

    An exec that runs out of time (`timed_out`, exit code 124) is not a death: every process it
    started is killed, Python code it was running in the interpreter gets KeyboardInterrupt, and
    the sandbox is kept (files, the interpreter's state, what earlier execs left running). Only
    an interpreter that does not stop within a grace period is replaced, over the same files,
    and the next exec has `interpreter_restarted` set (docs/sessions.md).
    `note` says what happened in words ("" when nothing did). `limit` names a limit of the sandbox
    that refused something during this exec ("" when none did): "shared_memory" when its shared
    memory (shared anonymous mappings such as `mmap.mmap(-1, n)`, memfds and /dev/shm, together
    at most its `shared_memory`, 512 MiB unless set) was full, so that an mmap got ENOMEM, a
    write ENOSPC or a process SIGBUS; `note` then says so too (docs/quotas.md).

    Under an egress policy with `record=True`, `egress_replay` says what the exec did with the
    network: "recorded" (its flows were recorded with its seed), "replayed" (they were served from
    the recording of an exec with the same sandbox state and seed: nothing was dialled), or
    "diverged" (a replay whose guest sent bytes the recording does not have, or made another
    connection: that connection was reset or refused, and `egress_error` says where); "" without
    recording.

    `platform` says what it ran on: "kvm" (a KVM virtual machine) or "systrap" (a confined host
    process under a trap-everything seccomp filter); see docs/platforms.md.
    """

    exit_code: int
    stdout: str
    stderr: str
    seed: str
    seed_ack: str
    duration: float
    timed_out: bool = False
    truncated: bool = False
    stdout_bytes: bytes = field(default=b"", repr=False)
    stderr_bytes: bytes = field(default=b"", repr=False)
    host: str | None = None
    interpreter_died: bool = False
    interpreter_restarted: bool = False
    note: str = ""
    limit: str = ""
    egress_replay: str = ""
    egress_error: str = ""
    platform: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out
