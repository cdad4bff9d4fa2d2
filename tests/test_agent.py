"""The in-guest agent on Debian's CPython: exec round trips, persistent state, snapshot and clone.

Needs /dev/kvm and the python rootfs (COLLIMATE_ROOTFS, set by scripts/test.sh).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from collimate_core import Vm

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

AGENT_DIR = Path(__file__).resolve().parent.parent / "python" / "collimate_core" / "guest"
AGENT_IDLE = 0x6167656E7400


def frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return len(data).to_bytes(4, "little") + data


def reply(r) -> dict:
    size = int.from_bytes(r.agent[:4], "little")
    return json.loads(r.agent[4 : 4 + size])


@pytest.fixture
def agent(rootfs, tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "tmp").mkdir()
    vm = Vm.spawn(
        rootfs,
        ["/usr/bin/python3", "/opt/collimate/agent.py"],
        env={"PATH": "/usr/bin:/bin"},
        cwd="/work",
        mounts={"/work": tmp_path / "work", "/tmp": tmp_path / "tmp"},
        ro_mounts={"/opt/collimate": AGENT_DIR},
        agent=True,
    )
    r = vm.run(60)
    assert (r.kind, r.value) == ("yield", AGENT_IDLE), r
    yield vm
    vm.destroy()


def test_exec_round_trip_keeps_state(agent):
    r = agent.agent_call(frame({"op": "exec", "code": "x = 41\nprint(sum(range(1000)))"}), 30)
    assert (r.kind, r.value) == ("yield", AGENT_IDLE)
    assert r.stdout == b"499500\n"
    assert reply(r)["exit_code"] == 0
    r = agent.agent_call(frame({"op": "exec", "code": "print(x + 1)"}), 30)
    assert r.stdout == b"42\n"


def test_errors_are_reported_not_fatal(agent):
    r = agent.agent_call(frame({"op": "exec", "code": "1/0"}), 30)
    assert reply(r)["exit_code"] == 1
    assert b"ZeroDivisionError" in r.stderr
    r = agent.agent_call(frame({"op": "exec", "code": "raise SystemExit(3)"}), 30)
    assert reply(r)["exit_code"] == 3
    r = agent.agent_call(frame({"op": "ping"}), 30)
    assert reply(r) == {"pong": True}


def test_snapshot_of_an_idle_agent_forks_children_with_its_state(agent, tmp_path):
    agent.agent_call(frame({"op": "exec", "code": "import hashlib\nshared = [i * i for i in range(100)]"}), 30)
    agent.snapshot(tmp_path / "snap")
    with Vm.restore(tmp_path / "snap") as zygote:
        kids = zygote.fork(4)
        try:
            for i, k in enumerate(kids):
                r = k.agent_call(frame({"op": "exec", "code": f"print(shared[{i}] + {i})"}), 30)
                assert r.stdout == f"{i * i + i}\n".encode()
        finally:
            for k in kids:
                k.destroy()


def test_requests_of_any_size_round_trip(agent):
    """The agent reads its channel in 16 KiB chunks (one VM exit for a usual request): requests
    smaller and much larger than that, one after another, each get exactly their own reply."""
    for size in [0, 10, 16384 - 60, 16384, 70_000, 1 << 20]:
        code = f"x = {size}\n" + "#" * size + "\nprint(x)"
        r = agent.agent_call(frame({"op": "exec", "code": code}), 30)
        assert r.stdout == f"{size}\n".encode(), (size, r.stderr[-500:])
        assert reply(r) == {"exit_code": 0, "seed_ack": None}
    r = agent.agent_call(frame({"op": "ping"}), 30)
    assert reply(r) == {"pong": True}


def test_unseeded_clones_do_not_share_random(agent, tmp_path):
    """`random` was seeded before the ready point; without a seed the agent reseeds it from the
    sandbox CRNG, which every clone mixes with fresh host entropy."""
    agent.snapshot(tmp_path / "snap")
    with Vm.restore(tmp_path / "snap") as zygote:
        kids = zygote.fork(4)
        try:
            outs = [k.agent_call(frame({"op": "exec", "code": "import random; print(random.random())"}), 30).stdout
                    for k in kids]
        finally:
            for k in kids:
                k.destroy()
    assert len(set(outs)) == 4, outs
