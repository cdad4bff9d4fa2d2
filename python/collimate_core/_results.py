"""Results of execs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExecResult:
    """What one exec did.

    `ok` is True when the program ran to completion with exit code 0 within its time budget.
    `seed` is always the seed the guest CRNG was pinned with (drawn fresh when none was given), so
    any result can be replayed; `seed_ack` is the verdict of the seed-ack handshake: "verified",
    "no-ack", "off" or "mismatch" (see docs/replay.md). `host` says where it ran: the Ray node id
    on a Ray client, None on one host.
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

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out
