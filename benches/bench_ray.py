"""Ray's overhead: 8 GRPO groups of 16 over a local Ray cluster against the same on the embedded
engine, in the same run.

A group: a session, a shared-prefix exec, fork_group(16), every child's exec of its candidate, and
teardown. Printed per exec (each child's `exec` call as the caller sees it) and per group (session
start to the group's teardown): median, p99, and the ratio Ray / embedded. Never asserted.

    python3 -m pytest benches/bench_ray.py -q -s      # or: python3 benches/bench_ray.py

The cluster is `ray.cluster_utils.Cluster` on loopback: a head and two nodes advertising
`collimate_host`, so the Ray figures include an actor call per exec (driver -> host actor over
gRPC and back) on the same 2-core machine, not a network hop.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

import pytest

GROUPS, WIDTH = 8, 16
PREFIX = "import json, math\ntask = {'n': 1000}\n"
CANDIDATES = [f"print(sum(range(task['n'])) + {i})" if i % 4 else "raise SystemExit(1)" for i in range(WIDTH)]


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]


def run_groups(client) -> tuple[list[float], list[float], list[float]]:
    """(per-exec seconds, per-group seconds, rewards) of GROUPS groups of WIDTH on `client`."""
    execs: list[float] = []
    groups: list[float] = []
    rewards: list[float] = []
    for _ in range(GROUPS):
        t0 = time.perf_counter()
        with client.session("python") as sess:
            sess.exec(code=PREFIX)
            with sess.fork_group(WIDTH) as grp:
                def run(i, child):
                    t = time.perf_counter()
                    r = child.exec(code=CANDIDATES[i])
                    execs.append(time.perf_counter() - t)
                    return 1.0 if r.ok else 0.0

                rewards += grp.map(run)
        groups.append(time.perf_counter() - t0)
    return execs, groups, rewards


def measure(write=print) -> None:
    from ray.cluster_utils import Cluster

    import collimate_core
    from collimate_core import EmbeddedClient, connect

    pkg = str(Path(collimate_core.__file__).resolve().parent.parent)
    if pkg not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # Ray's workers import collimate_core
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, os.environ.get("PYTHONPATH")) if p)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"collimate_host": 64})
    cluster.wait_for_nodes()
    try:
        ray_client = connect(ray=cluster.address)
        embedded = EmbeddedClient()
        for c in (embedded, ray_client):  # warm: templates loaded, zygotes up (both hosts for Ray)
            run_groups(c)
        ray_client.expect_width("python", 2)
        ray_client.release_template("python")
        # interleaved, so both see the same machine
        e_exec, e_group, r_exec, r_group = [], [], [], []
        for _ in range(2):
            x, g, rw = run_groups(embedded)
            e_exec += x
            e_group += g
            assert rw == [0.0 if i % 4 == 0 else 1.0 for i in range(WIDTH)] * GROUPS
            x, g, rw = run_groups(ray_client)
            r_exec += x
            r_group += g
            assert rw == [0.0 if i % 4 == 0 else 1.0 for i in range(WIDTH)] * GROUPS
        hosts = {e["host"] for e in ray_client.placement_log if e["op"] == "create"}
        embedded.close()
        ray_client.close()
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()

    write("")
    write(f"Ray vs embedded: 2 x {GROUPS} GRPO groups of {WIDTH} each ({len(e_exec)} child execs per side), "
          f"interleaved; Ray groups placed on {len(hosts)} host(s)")
    write(f"{'':18} {'embedded':>22} {'ray':>22} {'ray / embedded':>16} {'overhead (median)':>18}")
    for name, e, r in (("per exec", e_exec, r_exec), ("per group", e_group, r_group)):
        em, rm = statistics.median(e), statistics.median(r)
        write(f"{name:18} {em * 1e3:8.2f} ms (p99 {_p99(e) * 1e3:6.1f}) {rm * 1e3:8.2f} ms (p99 {_p99(r) * 1e3:6.1f}) "
              f"{rm / em:15.2f}x {(rm - em) * 1e3:15.2f} ms")


@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")
def test_ray_overhead(request):
    pytest.importorskip("ray")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    lines: list[str] = []
    measure(lines.append)
    for line in lines:
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line)


if __name__ == "__main__":
    sys.exit(measure())
