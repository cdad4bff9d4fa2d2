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
        self._work = _catalog.agent_dirs(prefix="collimate-zygote-")
        try:
            self.zygote = _catalog.spawn_agent(root, self._work, cpus, platform=self.platform)
            try:
                _catalog.run_to_idle(self.zygote, f"starting the {name!r} template on systrap")
            except BaseException:
                self.zygote.destroy()
                raise
        except BaseException:
            shutil.rmtree(self._work, ignore_errors=True)
            raise
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

    def clone(self) -> tuple[Vm, bool]:
        with self.lock:
            return self.zygote.clone(), False

    def close(self) -> None:
        self.zygote.destroy()
        shutil.rmtree(self._work, ignore_errors=True)


def template(name: str, cache: Path | None, disk_quota: int, shared_memory: int) -> LiveTemplate:
    """The systrap template `name`: the catalog's "python" (root filesystem built on first use,
    no /dev/kvm needed), else PlatformUnavailable saying what runs on systrap."""
    if name != "python":
        raise image_templates_unavailable(f"template {name!r} (an image template or a name the catalog lacks)")
    root = _catalog.python_root(cache)
    return LiveTemplate(name, root, disk_quota, shared_memory, _catalog.guest_cpus())
