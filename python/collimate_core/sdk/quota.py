"""Disk quotas and the host budget: how much of the host a sandbox may take.

A sandbox's writable mounts (`/tmp`, `/work`) share one quota: its own tmpfs, which the engine
makes with that size and inode count (see the engine's `quota` module). /dev/shm is shared memory
and is not on it: with the sandbox's shared anonymous mappings and memfds it is in a second tmpfs
of its own, its shared memory, of SHARED_MEMORY bytes unless set (docs/quotas.md). Past either the
guest gets ENOSPC, as on Linux; nothing outside the sandbox notices. The quota is set, first match wins:
per sandbox (`Sandbox(..., disk_quota=)`, `client.session(..., disk_quota=)`,
`rollout_once(..., disk_quota=)`), per template (`Template.bake(..., disk_quota=)`), per client or
server (`EmbeddedClient(disk_quota=)`, `collimate serve --disk-quota`, `COLLIMATE_DISK_QUOTA`),
else 1 GiB. A fork group's children get their parent's. The shared-memory limit is set the same
way (`shared_memory=` of the same calls, `collimate serve --shared-memory`, `COLLIMATE_SHARED_MEMORY`),
else 512 MiB.

The host budget (`memory_budget`, `collimate serve --memory-budget`, `COLLIMATE_MEMORY_BUDGET`) is
admission by worst case: every live sandbox is charged its guest memory, its shared memory and its
disk quota, and a
create or fork that would take the total past the budget waits in the queue, then fails with
CapacityError naming the budget. Off unless set: the worst case is far above what sandboxes use
(an idle clone holds about 130 KiB of private memory), so a budget sized to the host's memory
needs small quotas for wide groups (64 x (1.5 GiB + 256 MiB) = 112 GiB).
"""


from __future__ import annotations

import os
import re

from collimate_core.sdk.errors import InvalidArgument

# The guest directories the host may write into (uploads) and the guest's writes land in where the
# root is read-only (the catalog's templates, `Template.bake(read_only_root=True)`; an image
# template's root is writable): the one rule every error about a path that is not writable states
# (the engine's says the same).
WRITABLE_DIRS = ("/tmp", "/work", "/dev/shm")
WRITABLE_RULE = "the root is read-only here: only /tmp, /work, /dev/shm and a baked image's HOME are writable"

DEFAULT_DISK_QUOTA = 1 << 30
# Inodes that come with a quota: one per 16 KiB, at least 4096 (the engine's default is 65,536 for
# 1 GiB).
MIN_DISK_QUOTA = 1 << 20
# The guest memory of every sandbox (the engine's VMs are 1 GiB, sparse).
GUEST_MEMORY = 1 << 30
# Its shared memory (shared anonymous mappings, memfds, /dev/shm): a tmpfs of its own of half the
# guest memory, as Linux sizes /dev/shm (the engine's quota::SHARED_MEMORY).
SHARED_MEMORY = GUEST_MEMORY // 2
# What the host budget charges a sandbox of the default shared memory besides its disk quota.
MEMORY_CHARGE = GUEST_MEMORY + SHARED_MEMORY
# The smallest shared-memory limit (the engine's quota::MIN_SHARED_MEMORY).
MIN_SHARED_MEMORY = 1 << 20

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: object, what: str) -> int:
    """Bytes from an int or a string such as "512M", "1G", "1.5GiB". Raises InvalidArgument."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} takes a number of bytes or a size such as '512M', not {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", value)
        if not m:
            raise InvalidArgument(f"{what}: {value!r} is not a size; write bytes or e.g. '512M', '2G'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise InvalidArgument(f"{what} takes a number of bytes or a size such as '512M', not {type(value).__name__}")
    if n <= 0:
        raise InvalidArgument(f"{what} must be positive, not {value!r}")
    return n


def disk_quota(value: object) -> int:
    """A disk quota in bytes (at least 1 MiB)."""
    n = parse_size(value, "disk_quota")
    if n < MIN_DISK_QUOTA:
        raise InvalidArgument(f"disk_quota of {n} bytes is below the smallest, 1 MiB; give at least '1M'")
    return n


def shared_memory(value: object, memory_budget: int | None = None) -> int:
    """A shared-memory limit in bytes: at least 1 MiB and, with a host budget, within it."""
    try:
        n = parse_size(value, "shared_memory")
    except InvalidArgument as e:
        if "must be positive" not in str(e):
            raise
        raise InvalidArgument(
            f"shared_memory of {value!r}: a sandbox needs some shared memory (/dev/shm, multiprocessing); "
            f"give at least '1M' (default '{SHARED_MEMORY >> 20}M')"
        ) from None
    if n < MIN_SHARED_MEMORY:
        raise InvalidArgument(f"shared_memory of {n} bytes is below the smallest, 1 MiB; give at least '1M'")
    if memory_budget is not None and GUEST_MEMORY + n > memory_budget:
        raise InvalidArgument(
            f"shared_memory of {n >> 20} MiB with the sandbox's {GUEST_MEMORY >> 20} MiB of guest memory is above "
            f"memory_budget={memory_budget >> 20} MiB: no sandbox could be admitted; give at most "
            f"'{(memory_budget - GUEST_MEMORY) >> 20}M' or raise the budget"
        )
    return n


def default_shared_memory(memory_budget: int | None = None) -> int:
    env = os.environ.get("COLLIMATE_SHARED_MEMORY")
    if not env:
        return SHARED_MEMORY
    try:
        return shared_memory(env, memory_budget)
    except InvalidArgument as e:
        raise InvalidArgument(f"COLLIMATE_SHARED_MEMORY: {e}") from None


def memory_charge(shared: int | None = None) -> int:
    """What the host budget charges a sandbox besides its disk quota: guest memory and shared memory."""
    return GUEST_MEMORY + (SHARED_MEMORY if shared is None else shared)


def inodes_for(quota: int) -> int:
    """The inode limit that comes with a byte quota."""
    return max(4096, quota // (16 << 10))


def default_disk_quota() -> int:
    env = os.environ.get("COLLIMATE_DISK_QUOTA")
    return disk_quota(env) if env else DEFAULT_DISK_QUOTA


def default_memory_budget() -> int | None:
    env = os.environ.get("COLLIMATE_MEMORY_BUDGET")
    return parse_size(env, "COLLIMATE_MEMORY_BUDGET") if env else None
