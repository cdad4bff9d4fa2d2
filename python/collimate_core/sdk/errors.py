"""The exception hierarchy. Every error the SDK raises derives from `CollimateError`.

    CollimateError
    ├── EngineError                 the engine failed (KVM, a VMM process, the host)
    │   ├── SnapshotError           a snapshot file is damaged, from another version, or needs a CPU feature this host lacks
    │   ├── VmDestroyedError        a call on a destroyed low-level Vm
    │   └── SandboxDied             a sandbox's VMM process died: the sandbox is lost
    ├── SandboxTimeout              an operation ran out of time (also a TimeoutError)
    ├── NotFoundError               unknown template or sandbox (also a LookupError)
    ├── InvalidArgument             bad input, with what to do (also a ValueError)
    ├── CapacityError               a configured limit (live sandboxes, memory) is reached
    ├── PlatformUnavailable         the platform chosen (kvm, systrap) cannot run here; says what to do
    ├── GroupError                  a fork group lost a child: no partial group is returned
    │   └── HostLost                a Ray host (node or actor) was lost with the group on it
    └── AuthenticationError         a missing or wrong API key (remote clients)

An infrastructure failure is never turned into a reward: it raises one of these.
"""

from __future__ import annotations

from collimate_core._core import CollimateError, EngineError, SnapshotError, VmDestroyedError

__all__ = [
    "AuthenticationError",
    "CapacityError",
    "CollimateError",
    "EngineError",
    "GroupError",
    "HostLost",
    "InvalidArgument",
    "NotFoundError",
    "PlatformUnavailable",
    "SandboxDied",
    "SandboxTimeout",
    "SnapshotError",
    "VmDestroyedError",
]


class SandboxDied(EngineError):
    """The sandbox's VMM process died or stopped answering; create a new sandbox."""


class SandboxTimeout(CollimateError, TimeoutError):
    """An operation did not finish in its time budget."""


class NotFoundError(CollimateError, LookupError):
    """No template or sandbox by that name or id."""


class InvalidArgument(CollimateError, ValueError):
    """An argument is malformed; the message says what is expected."""


class CapacityError(CollimateError):
    """A configured limit is reached; the message names it."""


class PlatformUnavailable(CollimateError):
    """The platform a client chose (asked for, or auto's pick: docs/platforms.md) cannot run
    sandboxes on this host or in this build; the message says what is missing and what to do."""


class GroupError(CollimateError):
    """A fork group lost a child to an infrastructure failure; the group was torn down."""


class HostLost(GroupError):
    """The host holding a sandbox or a whole fork group (a Ray node, or its host actor) was lost;
    nothing of it was scored. Resample the group: it is placed on a host that is still there."""


class AuthenticationError(CollimateError):
    """The API key is missing or wrong."""


# How an error crosses HTTP (the control plane's responses, `collimate_core.server.errors`, and the
# remote client's exceptions, `sdk/remote.py`): the exception, the status of its response and the
# response's stable `type`. The server answers an exception with the first row it is an instance
# of (subclasses first); the remote client raises, for a `type`, the exception of its first row.
WIRE_ERRORS: tuple[tuple[type[CollimateError], int, str], ...] = (
    (AuthenticationError, 401, "authentication"),
    (InvalidArgument, 400, "invalid_argument"),
    (NotFoundError, 404, "not_found"),
    (VmDestroyedError, 404, "not_found"),
    (CapacityError, 503, "capacity"),
    (SandboxTimeout, 504, "timeout"),
    (SandboxDied, 410, "sandbox_died"),
    (PlatformUnavailable, 501, "platform_unavailable"),
    (EngineError, 500, "engine_error"),
)
# The `type`s of the server's own refusals (not raised by the SDK as such) -> the exception a
# remote client raises for them.
REFUSAL_ERRORS: dict[str, type[CollimateError]] = {
    "conflict": InvalidArgument,
    "forbidden_path": InvalidArgument,
    "payload_too_large": InvalidArgument,
    "image_quota": CapacityError,
    "spend_limit": CapacityError,
}
