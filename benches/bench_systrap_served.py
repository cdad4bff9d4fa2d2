"""A served sandbox on kvm and on systrap side by side (`_core.Vm.spawn(..., platform=...)`), each
beside the native baseline measured in the same run; see benches/conftest.py for the summary table
(median, p99, ratio to a host fork) and the `x_native` ratio under it:

- an agent exec of the command `true` (the agent's fork and exec of /bin/sh -c true) against
  `/bin/sh -c true` called directly;
- an agent exec of the code `x = 1` (one round trip through the agent's channel, no fork; there
  is no native equivalent, so only the host fork baseline);
- a clone of the idle agent and its first exec of code, then its destroy.

Needs the python rootfs (COLLIMATE_ROOTFS); the kvm rows need /dev/kvm.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

import pytest
from collimate_core import Vm

from conftest import host_fork_baseline

AGENT_DIR = Path(__file__).resolve().parent.parent / "python" / "collimate_core" / "guest"
AGENT_IDLE = 0x6167656E7400
PLATFORMS = ["kvm", "systrap"]
_medians: dict[str, float] = {}


def frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return len(data).to_bytes(4, "little") + data


def _record(benchmark, name: str, baseline: str | None = None) -> None:
    _medians[name] = statistics.median(benchmark.stats.stats.data)
    if baseline and baseline in _medians:
        benchmark.extra_info["x_native"] = round(_medians[name] / _medians[baseline], 2)


@pytest.fixture(scope="module", params=PLATFORMS)
def agent(request, tmp_path_factory):
    platform = request.param
    if platform == "kvm" and not os.path.exists("/dev/kvm"):
        pytest.skip("needs /dev/kvm")
    root = os.environ.get("COLLIMATE_ROOTFS")
    if not root:
        pytest.skip("no python rootfs (set COLLIMATE_ROOTFS)")
    d = tmp_path_factory.mktemp(f"agent-{platform}")
    (d / "work").mkdir()
    (d / "tmp").mkdir()
    vm = Vm.spawn(root, ["/usr/bin/python3", "/opt/collimate/agent.py"], env={"PATH": "/usr/bin:/bin"}, cwd="/work",
                  mounts={"/work": d / "work", "/tmp": d / "tmp"}, ro_mounts={"/opt/collimate": AGENT_DIR},
                  agent=True, platform=platform)
    r = vm.run(120)
    assert (r.kind, r.value) == ("yield", AGENT_IDLE), r
    yield vm
    vm.destroy()


def test_host_fork_baseline(benchmark):
    host_fork_baseline(benchmark)


def test_native_sh_true(benchmark):
    benchmark.pedantic(lambda: subprocess.run(["/bin/sh", "-c", "true"], check=True), rounds=40, warmup_rounds=3)
    _record(benchmark, "native true")


def test_agent_command_true(benchmark, agent):
    req = frame({"op": "exec", "command": "true"})

    def run():
        r = agent.agent_call(req, 60)
        assert (r.kind, r.value) == ("yield", AGENT_IDLE), r

    benchmark.pedantic(run, rounds=40, warmup_rounds=3)
    benchmark.extra_info["platform"] = agent.platform
    _record(benchmark, f"{agent.platform} true", "native true")


def test_agent_code_round_trip(benchmark, agent):
    req = frame({"op": "exec", "code": "x = 1"})

    def run():
        r = agent.agent_call(req, 60)
        assert (r.kind, r.value) == ("yield", AGENT_IDLE), r

    benchmark.pedantic(run, rounds=40, warmup_rounds=3)
    benchmark.extra_info["platform"] = agent.platform


def test_clone_exec_destroy(benchmark, agent):
    req = frame({"op": "exec", "code": "x = 1"})

    def run():
        kid = agent.clone()
        r = kid.agent_call(req, 60)
        assert (r.kind, r.value) == ("yield", AGENT_IDLE), r
        kid.destroy()

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    benchmark.extra_info["platform"] = agent.platform
