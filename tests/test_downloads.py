"""Downloads of what a hostile guest leaves in /work (issue 32, findings 5 and 6).

A FIFO (or a directory) is refused at once with an error that says what it is, and the sandbox
goes on; before, the VMM blocked in its open for 120 s and the sandbox was then killed as "VMM
process ... is gone". A sparse file costs the guest no quota but its whole size to read: a file
over the client's max_download is refused before a byte is read, and one under it is read once,
by the controller, straight from the file the VMM opened (before, the VMM read it into memory
and framed it, and the controller decoded it and copied it again: 3.6 GiB for 900 MiB).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
from collimate_core import EmbeddedClient, InvalidArgument, Sandbox

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

MiB = 1 << 20


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    c = EmbeddedClient(max_download=512 * MiB)
    yield c
    c.close()


def still_usable(sb) -> None:
    r = sb.exec(command="echo alive", timeout_seconds=60)
    assert r.ok and r.stdout == "alive\n", r
    sb.upload_bytes("/work/after", b"after")
    assert sb.download("/work/after") == b"after"


def hwm(pid: int) -> int:
    """Peak resident memory of process `pid` in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_fifo_or_a_directory_is_refused_at_once_and_the_sandbox_goes_on(client):
    with Sandbox("python", client=client) as sb:
        r = sb.exec(command="mkfifo /work/fifo && mkdir /work/d && ls -l /work", timeout_seconds=60)
        assert r.ok, r
        for path, kind in (("/work/fifo", "FIFO"), ("/work/d", "directory")):
            with pytest.raises(InvalidArgument, match=f"{kind}.*only regular files can be downloaded"):
                sb.download(path)
        still_usable(sb)


def test_a_sparse_file_over_the_limit_is_refused_before_it_is_read(client):
    with Sandbox("python", client=client) as sb:
        r = sb.exec(command="truncate -s 900M /work/sparse", timeout_seconds=60)
        assert r.ok, r
        usage = sb.disk_usage()
        assert usage is None or usage["bytes"] < MiB  # no quota spent
        vmm = sb._live().vm.pid
        before = hwm(vmm)
        with pytest.raises(InvalidArgument, match=r"943718400 bytes, over the download limit of 536870912 bytes"):
            sb.download("/work/sparse")
        assert hwm(vmm) - before < 16 * MiB
        still_usable(sb)


def test_a_file_under_the_limit_is_read_once_by_the_controller_only():
    size = 300 * MiB
    # A client of its own: a recycled sandbox's VMM would carry an earlier test's peak.
    client = EmbeddedClient(max_download=512 * MiB)
    try:
        _read_once(client, size)
    finally:
        client.close()


def _read_once(client, size: int) -> None:
    with Sandbox("python", client=client) as sb:
        r = sb.exec(command=f"truncate -s {size} /work/sparse && printf end >> /work/sparse", timeout_seconds=60)
        assert r.ok, r
        vmm = sb._live().vm.pid
        vmm_before = hwm(vmm)
        me_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        data = sb.download("/work/sparse")
        me_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"download of {size >> 20} MiB: VMM peak +{(hwm(vmm) - vmm_before) >> 20} MiB, "
              f"controller peak +{(me_after - me_before) >> 20} MiB")
        assert len(data) == size + 3 and data[-3:] == b"end" and data[:4096] == bytes(4096)
        del data
        # The VMM opened the file and handed it over: it read none of it.
        assert hwm(vmm) - vmm_before < 16 * MiB
        # The controller holds the result and nothing more (a peak, so at most: it may have been
        # higher already).
        assert me_after - me_before < size + 64 * MiB
        still_usable(sb)


def test_the_limit_is_the_clients(client, monkeypatch):
    monkeypatch.setenv("COLLIMATE_MAX_DOWNLOAD", "1M")
    small = EmbeddedClient()
    try:
        with Sandbox("python", client=small) as sb:
            sb.upload_bytes("/work/two", bytes(2 * MiB))
            with pytest.raises(InvalidArgument, match="over the download limit of 1048576 bytes.*max_download"):
                sb.download("/work/two")
            sb.upload_bytes("/work/one", bytes(MiB))
            assert sb.download("/work/one") == bytes(MiB)
    finally:
        small.close()
    with pytest.raises(InvalidArgument, match="max_download"):
        EmbeddedClient(max_download="lots")
