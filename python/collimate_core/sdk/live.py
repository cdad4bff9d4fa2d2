"""Templates on a platform without snapshots (systrap): a live zygote instead of a checkpoint.

On kvm a template is a snapshot and its zygote a VMM restored from it (sdk/embedded.py). A systrap
sandbox cannot be checkpointed yet (docs/systrap.md), so there a template's zygote is the agent
itself: spawned with the argv, environment and mounts every python template has
(`templates.catalog.spawn_agent`), run once to its ready point at the template's first use, and
never run again. Sandboxes are its clones (a fork of its stub plus a host fork of its VMM: guest
memory shared copy-on-write, writable mounts copied). There is no spare pool and no recycling by
reset (the engine has neither on systrap): a sandbox that ends is destroyed, and one whose
interpreter is lost is replaced by a new clone.

Only the catalog "python" template exists here: it needs the root filesystem alone, not /dev/kvm.
Image templates (Template.bake, `client.env(image)`) are baked into snapshots and are refused on
systrap with `PlatformUnavailable` saying what runs there today.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path

from collimate_core._core import EngineError as _CoreEngineError
from collimate_core._core import Vm
from collimate_core.sdk.errors import PlatformUnavailable
from collimate_core.templates import catalog as _catalog
from collimate_core.templates.catalog import Baked

# What runs on systrap today, for the errors that refuse the rest.
SYSTRAP_RUNS = (
    "on the systrap platform the embedded engine runs the catalog template 'python' (sessions, execs, "
    "fork groups, grading, seeds)"
)
SYSTRAP_HELP = "use platform='kvm' (connect(platform='kvm')) on a host where /dev/kvm opens and creates a VM"


def image_templates_unavailable(what: str) -> PlatformUnavailable:
    """The error for an image template (or anything baked into a snapshot) asked for on systrap."""
    return PlatformUnavailable(
        f"{what} is not supported on the systrap platform yet: image templates are baked into snapshots, which "
        f"systrap sandboxes do not have; {SYSTRAP_RUNS}. For image templates {SYSTRAP_HELP}"
    )


class LiveTemplate:
    """A template whose zygote is a live agent at its ready point (the surface of embedded's
    `_Template` that the client uses: `baked`, `zygote`, `state`, quotas, `clone`, and no pool)."""

    platform = "systrap"

    def __init__(self, name: str, root: Path, disk_quota: int, shared_memory: int, cpus: int = 1):
        self.baked = Baked(name, root, root, True)
        self.lock = threading.Lock()
        self.disk_quota = disk_quota
        self.shared_memory = shared_memory
        self.spares = 0
        self._cpus = cpus
        self._work: Path | None = None
        self.zygote = self._start()
        # The state its sandboxes start from, as egress recordings name it: what the zygote was
        # started from (a new root filesystem or agent is another state).
        self.state = hashlib.sha256(
            f"collimate/live-template/v1\0{name}\0{root}\0{_catalog._agent_hash()}\0{cpus}\0"
            f"{_catalog.TEMPLATE_VERSION}".encode()
        ).hexdigest()

    # No recycling: a sandbox that ends is destroyed (reset is not served on systrap).
    def take_recycled(self) -> Vm | None:
        return None

    def has_room(self) -> bool:
        return False

    def offer(self, vm: Vm) -> bool:
        return False

    def drain(self) -> None:
        pass

    def set_spares(self, n: int) -> None:
        """No spare pool on systrap (the engine refuses one): a width is a hint, and each
        sandbox is cloned when asked for."""

    def _start(self) -> Vm:
        """Spawn the agent in new writable mounts and run it to its ready point: the zygote."""
        work = _catalog.agent_dirs(prefix="collimate-zygote-")
        try:
            vm = _catalog.spawn_agent(self.baked.root, work, self._cpus, platform=self.platform)
            try:
                _catalog.run_to_idle(vm, f"starting the {self.baked.name!r} template on systrap")
            except BaseException:
                vm.destroy()
                raise
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        self._work = work
        return vm

    def clone(self) -> tuple[Vm, bool]:
        with self.lock:
            try:
                return self.zygote.clone(), False
            except _CoreEngineError as e:
                if "is gone" not in str(e):
                    raise
            # The zygote's VMM died (it is a live process here, not a file): start a new one, once.
            self._stop()
            self.zygote = self._start()
            return self.zygote.clone(), False

    def _stop(self) -> None:
        self.zygote.destroy()
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    def close(self) -> None:
        with self.lock:
            self._stop()


def template(name: str, cache: Path | None, disk_quota: int, shared_memory: int) -> LiveTemplate:
    """The systrap template `name`: the catalog's "python" (root filesystem built on first use,
    no /dev/kvm needed), else PlatformUnavailable saying what runs on systrap."""
    if name != "python":
        raise image_templates_unavailable(f"template {name!r} (an image template or a name the catalog lacks)")
    root = _catalog.python_root(cache)
    return LiveTemplate(name, root, disk_quota, shared_memory, _catalog.guest_cpus())
