"""A fork group on systrap (docs/systrap.md, "fork_group(64)"): the forking VMM hands its stub the
next child's fork before it forks itself for the previous child, so the two forks of each child
run at once; the children are the same either way (the session's state, their own seeds, replay)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from platforms import systrap_client

RUN = r"""
import json, sys
from collimate_core import connect
c = connect(platform="systrap")
with c.session("python") as s:
    s.exec(code="base = 1000")
    with s.fork_group(8, seed="5eed" * 16) as grp:
        out = grp.map(lambda i, ch: ch.exec(code=f"import random, os\nprint(base + {i}, random.random(), os.urandom(4).hex())"))
print(json.dumps([[r.stdout, r.seed, r.seed_ack] for r in out]))
"""


@pytest.fixture(scope="module", autouse=True)
def _systrap():
    systrap_client()  # skips where the host allows no seccomp filter


def _run(**env):
    e = dict(os.environ, COLLIMATE_TRACE="1", **env)
    for k in ("COLLIMATE_API_KEY", "COLLIMATE_RAY_ADDRESS"):
        e.pop(k, None)
    p = subprocess.run([sys.executable, "-c", RUN], env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    marks = [ln.split() for ln in p.stderr.splitlines() if ln.startswith("collimate-trace ")]
    # The session's VMM's marks, in order: the process that forked most (the zygote's forks of
    # one clone each, the session and the spares, mark too).
    begins = [m[2] for m in marks if m[3] == "fork.begin"]
    forker = max(set(begins), key=begins.count)
    steps = [m[3] for m in marks if m[2] == forker and m[3].startswith("fork.")]
    return json.loads(p.stdout.strip().splitlines()[-1]), steps


def test_a_fork_groups_stub_forks_overlap_its_host_forks_and_give_the_same_children():
    """With the overlap (the default) the stub is handed child i+1's fork (`fork.next`) between
    child i's stub fork and its host fork of the VMM; with `COLLIMATE_SYSTRAP_FORK_OVERLAP=0` it
    is not (what systrap did before, one fork after the other). Fails on the code before, which
    has no overlap. Both give the same children: the session's state, one seed each from the
    group's, verified, and the same output for the same group seed."""
    out, steps = _run()
    before, steps_before = _run(COLLIMATE_SYSTRAP_FORK_OVERLAP="0")
    # Per child: stub fork done, the next one handed over, the host fork, Forked sent; the last
    # child has no next.
    want = ["fork.begin", "fork.stub", "fork.next", "fork.vmm", "fork.sent"] * 7 + ["fork.begin", "fork.stub", "fork.vmm", "fork.sent"]
    assert steps == want, steps
    assert steps_before == ["fork.begin", "fork.stub", "fork.vmm", "fork.sent"] * 8, steps_before
    assert [o[0].split()[0] for o in out] == [str(1000 + i) for i in range(8)]
    assert len({o[1] for o in out}) == 8 and {o[2] for o in out} == {"verified"}, out
    assert len({o[0] for o in out}) == 8, out
    assert out == before


def test_back_to_back_maps_run_on_the_same_threads_and_nested_maps_do_not_wait():
    """`ForkGroup.map` keeps its threads for the next map (sdk/workers.py): a second map's calls
    run on threads the first one's calls ran on, so it starts none (on main each map started a
    `ThreadPoolExecutor` of its own: the thread-local mark below is missing there). A map inside
    a map's call gets threads of its own (no call waits for a busy one), and results keep their
    order, an exception of `fn` propagates and a bad width is refused."""
    import threading

    from collimate_core.sdk.errors import InvalidArgument

    c = systrap_client()
    mark = threading.local()
    with c.session("python") as s, s.fork_group(4) as grp:

        def first(i, child):
            mark.seen = True
            return child.exec(code=f"print({i})").stdout

        assert grp.map(first) == [f"{i}\n" for i in range(4)]
        assert grp.map(lambda i, child: getattr(mark, "seen", False)) == [True] * 4
        # Nested: each outer call maps the whole group again while all 4 outer calls are running.
        barrier = threading.Barrier(4, timeout=60)

        def outer(i, child):
            barrier.wait()
            return grp.map(lambda j, k: i * 10 + j)

        assert grp.map(outer) == [[i * 10 + j for j in range(4)] for i in range(4)]
        with pytest.raises(ZeroDivisionError):
            grp.map(lambda i, child: 1 // (i - 2))
    with c.session("python") as s, s.fork_group(2) as grp:
        with pytest.raises(InvalidArgument, match="max_workers"):
            grp.map(lambda i, child: i, max_workers=-1)




def test_a_restored_zygote_populates_only_the_pages_its_snapshot_holds():
    """The template's zygote is restored from its systrap snapshot with the page-table entries of
    the pages the memory file holds data for, not of its holes (pages the process never had: most
    of the guest stack's 8 MiB), which every stub fork copied and every exit tore down. So a
    session's stub (a clone of the zygote) has few resident pages in its stack mapping; with
    `COLLIMATE_SYSTRAP_PREFAULT_HOLES=1` (what the restore did before, and main) all 8 MiB."""

    def stack_rss_kb(env: dict) -> int:
        code = (
            "import os, sys\n"
            "sys.path.insert(0, " + repr(os.path.dirname(__file__)) + ")\n"
            "from hostprocs import stub_of\n"
            "from collimate_core import connect\n"
            "c = connect(platform='systrap')\n"
            "with c.session('python') as s:\n"
            "    assert s.exec(code='x = 1').ok\n"
            "    stub = stub_of(s._box.vm.pid)\n"
            "    rss, cur = None, False\n"
            "    for line in open(f'/proc/{stub}/smaps'):\n"
            "        f = line.split()\n"
            "        if not f[0].endswith(':'):\n"
            "            a, b = (int(x, 16) for x in f[0].split('-'))\n"
            "            cur = b - a == 8 << 20 and line.rstrip().endswith('systrap.mem')\n"
            "        elif f[0] == 'Rss:' and cur:\n"
            "            rss = int(f[1])\n"
            "    print(rss)\n"
        )
        e = dict(os.environ, **env)
        for k in ("COLLIMATE_API_KEY", "COLLIMATE_RAY_ADDRESS"):
            e.pop(k, None)
        p = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return int(p.stdout.split()[-1])

    now = stack_rss_kb({})
    before = stack_rss_kb({"COLLIMATE_SYSTRAP_PREFAULT_HOLES": "1"})
    assert before >= 8000, before  # the whole 8 MiB stack mapping
    assert now < 2048, now
