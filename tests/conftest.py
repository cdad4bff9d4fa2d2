"""Test-suite policy shared by every test file.

On a host with /dev/kvm, CI sets COLLIMATE_REQUIRE_KVM=1: a test marked `kvm` that skips is then
reported as a failure, so a KVM host can never pass CI without running the KVM tests. Likewise
COLLIMATE_REQUIRE_SYSTRAP=1 fails a platform-matrix case skipped because systrap is unavailable.

The platform matrix: a test that takes the `platform` fixture runs on kvm and on systrap in the
same run (tests/platforms.py).
"""

from __future__ import annotations

import functools
import os

import pytest
from platforms import selected


def pytest_configure(config):
    config.addinivalue_line("markers", "both_platforms: runs once per platform, kvm and systrap (the `platform` "
                            "fixture; tests/platforms.py)")
    config.addinivalue_line("markers", "platform_marks(platform, *marks): marks for one platform's case only")


@functools.cache
def _systrap_offer():
    from collimate_core.sdk import platform as pf

    return pf.probe_systrap()


def _param_marks(metafunc, platform: str) -> list:
    marks = [pytest.mark.both_platforms]
    if platform == "kvm":
        marks += [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]
    else:
        offer = _systrap_offer()
        marks.append(pytest.mark.skipif(not offer.available, reason=f"systrap unavailable: {offer.why}"))
    return marks


def pytest_collection_modifyitems(config, items):
    """`platform_marks(p, *marks)` (tests/platforms.py `on`), on a test or one of its params: the
    marks apply to its platform-`p` case only."""
    for item in items:
        spec = getattr(item, "callspec", None)
        p = spec.params.get("platform") if spec else None
        if p is None:
            continue
        for m in item.iter_markers("platform_marks"):
            if m.args and m.args[0] == p:
                for mark in m.args[1:]:
                    item.add_marker(mark)


def pytest_generate_tests(metafunc):
    """`platform`: each test that takes it runs on kvm and on systrap (COLLIMATE_TEST_PLATFORMS)."""
    if "platform" in metafunc.fixturenames:
        metafunc.parametrize(
            "platform",
            [pytest.param(p, marks=_param_marks(metafunc, p), id=p) for p in selected()],
            indirect=True,
            scope="module",
        )


@pytest.fixture(scope="module")
def platform(request) -> str:
    p = request.param
    if p == "systrap" and os.environ.get("COLLIMATE_TEST_NO_KVM") == "1":
        # CI's step with /dev/kvm hidden: check that it really is (a run that could use KVM
        # would not show that systrap needs none).
        from collimate_core.sdk import platform as pf

        kvm = pf.probe_kvm()
        assert not kvm.available, f"COLLIMATE_TEST_NO_KVM=1 but KVM is usable here: {kvm.why}"
    return p


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # Only a skip for want of KVM (or of the rootfs the KVM tests run) is turned into a failure; a
    # test may still skip for another stated reason (e.g. numpy not being in the template).
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr).lower()
    if (
        report.skipped
        and os.environ.get("COLLIMATE_REQUIRE_KVM") == "1"
        and item.get_closest_marker("kvm") is not None
        and ("kvm" in reason or "rootfs" in reason)
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} needs KVM and was skipped, but COLLIMATE_REQUIRE_KVM=1: "
            "this host has /dev/kvm, so the KVM tests must run (check its permissions)"
        )
    if (
        report.skipped
        and os.environ.get("COLLIMATE_REQUIRE_SYSTRAP") == "1"
        and "systrap unavailable" in reason
    ):
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid}: systrap was unavailable, but COLLIMATE_REQUIRE_SYSTRAP=1 ({reason})"


@pytest.fixture(scope="module")
def rootfs() -> str:
    """The python template's root filesystem, for tests that run guest programs below the SDK
    (scripts/test.sh builds it and sets COLLIMATE_ROOTFS)."""
    if not os.path.exists("/dev/kvm"):
        pytest.skip("needs /dev/kvm")
    root = os.environ.get("COLLIMATE_ROOTFS")
    if not root:
        if os.environ.get("COLLIMATE_REQUIRE_KVM") == "1":
            pytest.fail("COLLIMATE_ROOTFS is not set: build it with `python3 guest/rootfs/build.py`")
        pytest.skip("no python rootfs (set COLLIMATE_ROOTFS)")
    return root


@pytest.fixture(scope="module", autouse=True)
def _leaked_systrap_stubs(request):
    """After each module (its sandboxes closed: this fixture is set up first, so torn down last),
    systrap stubs that it left behind, reparented to init, are killed and reported as a warning (pytest's warnings summary).

    A safety net, not a test: each sandbox's reaper ends its stubs with their VMMs (docs/systrap.md,
    "Lifetimes"; tests/test_systrap_reaper.py and crates/engine/tests/systrap_reaper.rs assert it).
    Should a stub that computes without syscalls outlive its VMM again, it would spin on a host CPU
    for good: it is killed here so that one module's leak does not load the rest of the run, and
    listed so that it is seen. Stubs are told apart only by their host user, so on a host shared with
    other runs a "LEAK" may be theirs."""
    from hostprocs import orphaned_stubs

    before = orphaned_stubs()
    yield
    import signal
    import time
    import warnings

    deadline = time.monotonic() + 2
    while (left := orphaned_stubs() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        warnings.warn(f"LEAK: {request.module.__name__} left systrap stubs running after its sandboxes ended "
                      f"(killed by the test suite): {sorted(left)} (docs/systrap.md, 'Lifetimes')", stacklevel=1)
