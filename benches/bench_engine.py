"""Benchmarks of the low-level API; see benches/conftest.py for the summary table.

Each benchmark times only the operation named; creating and destroying what it needs happens in
untimed setup/teardown.
"""

from __future__ import annotations

import os

import pytest

from conftest import host_fork_baseline
from guestprogs import CMD_FILL, MAILBOX, MAILBOX_SIZE, PAGE_SIZE, mailbox_result, pack_mailbox

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

DIRTY_10_MIB = (10 << 20) // PAGE_SIZE


def _command(vm, cmd, arg0=0, arg1=0, arg2=0):
    vm.write_mem(MAILBOX, pack_mailbox(cmd, arg0, arg1, arg2))
    r = vm.run(10.0)
    assert (r.kind, r.value) == ("yield", cmd), r
    return mailbox_result(vm.read_mem(MAILBOX, MAILBOX_SIZE))


class _Reaper:
    """Collects the VMs a round created; destroys them after the round (untimed) and at the end."""

    def __init__(self):
        self.vms = []

    def setup(self):
        return (self,), {}

    def teardown(self, _self=None):
        while self.vms:
            self.vms.pop().destroy()


@pytest.fixture
def reaper():
    r = _Reaper()
    yield r
    r.teardown()


def test_host_fork_baseline(benchmark):
    host_fork_baseline(benchmark)


def test_clone_to_first_instruction(benchmark, zygote, reaper):
    """clone() + run() of a zygote paused at ready, to the clone's first yield."""

    def clone_and_run(r):
        vm = zygote.clone()
        r.vms.append(vm)
        res = vm.run(10.0)
        assert res.kind == "yield", res

    benchmark.pedantic(
        clone_and_run, setup=reaper.setup, teardown=reaper.teardown, rounds=300, warmup_rounds=10
    )


def test_clone_to_first_instruction_with_spares(benchmark, zygote, reaper):
    """As above, with the zygote keeping 2 pre-forked clones ready (refilled at idle priority)."""
    import time

    zygote.set_spare_pool(2)

    def clone_and_run(r):
        vm = zygote.clone()
        r.vms.append(vm)
        res = vm.run(10.0)
        assert res.kind == "yield", res

    def setup():
        time.sleep(0.003)  # a trainer does work between clones; the pool refills meanwhile
        return reaper.setup()

    try:
        benchmark.pedantic(clone_and_run, setup=setup, teardown=reaper.teardown, rounds=300, warmup_rounds=10)
    finally:
        zygote.set_spare_pool(0)


@pytest.mark.parametrize("n", [1, 64])
def test_live_fork_10mib_dirty(benchmark, zygote, reaper, n):
    parent = zygote.clone()
    reaper.vms.append(parent)  # destroyed last, by the fixture
    assert _command(parent, CMD_FILL, DIRTY_10_MIB, 0xAB, 0) == DIRTY_10_MIB
    kids = _Reaper()

    def fork(r):
        r.vms.extend(parent.fork(n))

    benchmark.pedantic(
        fork,
        setup=kids.setup,
        teardown=kids.teardown,
        rounds=100 if n == 1 else 10,
        warmup_rounds=1,
    )
    kids.teardown()
    benchmark.extra_info["parent_dirty_pages"] = parent.mem_stats()["dirty_pages"]


@pytest.mark.parametrize("pages", [10, 100, 1000])
def test_reset_dirty_pages(benchmark, zygote, reaper, pages):
    vm = zygote.clone()
    reaper.vms.append(vm)

    def dirty():
        assert _command(vm, CMD_FILL, pages, 0x5A, 0) == pages

    stats = []
    benchmark.pedantic(lambda: stats.append(vm.reset()), setup=dirty, rounds=100, warmup_rounds=3)
    assert all(s["dirty_pages"] >= pages for s in stats), stats[:3]
    engine = sorted(s["duration"] for s in stats)
    benchmark.extra_info["engine_reported_median_s"] = round(engine[len(engine) // 2], 7)


def test_mem_stats_of_an_idle_clone(benchmark, zygote, reaper):
    """Times mem_stats() and records the private memory of a clone that was never run."""
    vm = zygote.clone()
    reaper.vms.append(vm)
    stats = benchmark.pedantic(vm.mem_stats, rounds=50)
    benchmark.extra_info["idle_clone_private_bytes"] = stats["private_bytes"]
    vm.run(10.0)
    benchmark.extra_info["after_first_run_private_bytes"] = vm.mem_stats()["private_bytes"]
