"""collimate_core: a KVM fork engine for RL rollouts.

The SDK surface (also importable as `collimate_rl`): `connect()`, `Sandbox`, `rollout_once`,
sessions and fork groups, seeds for deterministic replay. The low-level engine API: `Vm`, a handle
to one VMM process running one guest. Errors derive from `CollimateError`.

The package, one folder per layer (each subpackage's docstring says what is in it and why):
- sdk/: clients (connect, embedded, remote), sandboxes, sessions, fork groups, results, seeds,
  errors, disk quotas, usage metering; every other layer builds on it;
- templates/: the catalog (the python template), baking from images, OCI images, the rootfs
  recipe, the on-disk cache;
- grading/: unit-test, property and stdin/stdout rewards, grade_many, prepared grading templates;
- server/: the HTTP control plane (`collimate serve|keys|openapi`);
- ray/: scale-out over a Ray cluster (host actors, RayClient, `collimate ray-host`);
- guest/: what runs inside the VM (the agent, PID 1 of a template; not imported on the host);
- aio.py: the async twin of the SDK; integrations/: TRL, veRL, score_rows;
- _core: the compiled engine (crates/py), with its stubs in _core.pyi.
The public names are the ones below, re-exported here; the subpackages' modules are internal.
"""

from collimate_core._core import OUTPUT_CAP, SNAPSHOT_FORMAT, SYSTRAP_SNAPSHOT_FORMAT, RunResult, Vm
from collimate_core._core import _egress_start
from collimate_core.templates.bake import BuildError, Ready, Template, TemplateHandle, TemplateStatus
from collimate_core.sdk.client import connect
from collimate_core.sdk.egress import Egress
from collimate_core.sdk.embedded import EmbeddedClient, Usage
from collimate_core.sdk.errors import (
    AuthenticationError,
    CapacityError,
    CollimateError,
    EngineError,
    GroupError,
    HostLost,
    InvalidArgument,
    NotFoundError,
    PlatformUnavailable,
    SandboxDied,
    SandboxTimeout,
    SnapshotError,
    VmDestroyedError,
)
from collimate_core.templates.oci import ImageError
from collimate_core.templates.image import Image, ImageBuildError
from collimate_core.grading.grade import (
    GradeResult,
    PropertyReward,
    UnitTestReward,
    extract_code,
    grade,
    grade_batch,
    trl_reward_func,
)
from collimate_core.grading.iotest import IOGradeResult, IOTestReward, outputs_match
from collimate_core.grading.grade_many import grade_many
from collimate_core.ray.client import RayClient, RaySandbox
from collimate_core.sdk.remote import RemoteClient, RemoteSandbox
from collimate_core.sdk.results import ExecResult
from collimate_core.sdk.seeds import fresh_seed, group_seeds, parse_seed, seed_from_key
from collimate_core.sdk.session import Env, ForkGroup, Sandbox, Session, rollout_once

__all__ = [
    "OUTPUT_CAP",
    "SNAPSHOT_FORMAT",
    "SYSTRAP_SNAPSHOT_FORMAT",
    "AuthenticationError",
    "BuildError",
    "CapacityError",
    "CollimateError",
    "Egress",
    "EmbeddedClient",
    "EngineError",
    "Env",
    "ExecResult",
    "ForkGroup",
    "GradeResult",
    "GroupError",
    "HostLost",
    "IOGradeResult",
    "IOTestReward",
    "Image",
    "ImageBuildError",
    "ImageError",
    "InvalidArgument",
    "NotFoundError",
    "PlatformUnavailable",
    "PropertyReward",
    "Ready",
    "RayClient",
    "RaySandbox",
    "RemoteClient",
    "RemoteSandbox",
    "RunResult",
    "Sandbox",
    "SandboxDied",
    "SandboxTimeout",
    "Session",
    "SnapshotError",
    "Template",
    "TemplateHandle",
    "TemplateStatus",
    "UnitTestReward",
    "Usage",
    "Vm",
    "VmDestroyedError",
    "connect",
    "extract_code",
    "fresh_seed",
    "grade",
    "grade_batch",
    "grade_many",
    "group_seeds",
    "outputs_match",
    "parse_seed",
    "rollout_once",
    "seed_from_key",
    "trl_reward_func",
]

# The egress broker (the trusted side of sandboxes' network access, docs/egress.md) runs from
# import on: its thread and descriptor are the package's, not the first sandbox's.
_egress_start()
