"""Test-suite policy shared by every test file.

On a host with /dev/kvm, CI sets COLLIMATE_REQUIRE_KVM=1: a test marked `kvm` that skips is then
reported as a failure, so a KVM host can never pass CI without running the KVM tests.
"""

from __future__ import annotations

import os

import pytest


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
