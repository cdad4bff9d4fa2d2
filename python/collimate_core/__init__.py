"""collimate_core: a KVM fork engine for RL rollouts.

The low-level API: a `Vm` is a handle to one VMM process running one guest; `run()` returns a
`RunResult`. Errors derive from `CollimateError`.
"""

from collimate_core._core import (
    CollimateError,
    EngineError,
    RunResult,
    SnapshotError,
    Vm,
    VmDestroyedError,
)

__all__ = [
    "CollimateError",
    "EngineError",
    "RunResult",
    "SnapshotError",
    "Vm",
    "VmDestroyedError",
]
