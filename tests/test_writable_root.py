"""A writable root like a container's (docs/templates.md, "The writable root"; crates/engine/src/overlay.rs).

Real parts: an image from the SDK's builder (the python template's Debian root filesystem, PyPI's
pip, setuptools and wheel), a wheel and a project made here and installed in the sandbox by the
image's own pip, Debian's coreutils and the image's shell. Writes anywhere in the image's tree land
in the sandbox's copy-up layer (the host's overlayfs, its upper layer on the sandbox's disk-quota
tmpfs): forks inherit it, reset drops it, the quota counts it, a bake keeps what its Ready step wrote.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import zipfile
from pathlib import Path

import pytest

from collimate_rl import Image, InvalidArgument, Ready, Template, connect

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

SITE = "/usr/local/lib/python3.11/dist-packages"
PIP = "python3 -m pip install --no-index --no-build-isolation --disable-pip-version-check"


def _wheel(out: Path, name: str, source: str) -> Path:
    """A pure-Python wheel of module `name` (version 0.1), written as the wheel format says."""
    files = {
        f"{name}/__init__.py": source.encode(),
        f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
        f"{name}-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{name}-0.1.dist-info/RECORD,,")
    files[f"{name}-0.1.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, data in files.items():
            z.writestr(zipfile.ZipInfo(path, (2020, 1, 1, 0, 0, 0)), data)
    whl = out / f"{name}-0.1-py3-none-any.whl"
    whl.write_bytes(buf.getvalue())
    return whl


@pytest.fixture(scope="module")
def tpl(tmp_path_factory):
    """One template: pip, setuptools and wheel from PyPI; two wheels and a project under /work;
    a Ready step that pip-installs one wheel into the system site-packages."""
    d = tmp_path_factory.mktemp("wr")
    dist = d / "dist"
    dist.mkdir()
    _wheel(dist, "greet", "def hello():\n    return 'hello from greet'\n")
    _wheel(dist, "bakedpkg", "WHERE = 'baked'\n")
    proj = d / "proj"
    (proj / "edit").mkdir(parents=True)
    (proj / "edit" / "__init__.py").write_text("WORD = 'editable'\n")
    (proj / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "edit"\nversion = "0.1"\n'
    )
    image = (Image.debian_slim().pip_install("pip", "setuptools", "wheel")
             .add_local_dir(dist, "/work/dist").add_local_dir(proj, "/work/proj"))
    client = connect()
    handle = Template.bake(client, name="test-writable-root", image=image,
                           ready=Ready(cmd=f"{PIP} /work/dist/bakedpkg-0.1-py3-none-any.whl"))
    st = handle.wait(timeout=900)
    assert st.phase == "Live", st.log
    yield client, handle
    Template.delete(client, "test-writable-root")


def test_pip_installs_into_the_system_site_packages(tpl):
    client, handle = tpl
    with client.session(handle) as s:
        r = s.exec(command=f"{PIP} /work/dist/greet-0.1-py3-none-any.whl", timeout_seconds=600)
        assert r.ok and "user installation" not in r.stdout + r.stderr, (r.stdout, r.stderr)
        r = s.exec(command="cd / && python3 -c 'import greet; print(greet.hello(), greet.__file__)'")
        assert r.ok and r.stdout == f"hello from greet {SITE}/greet/__init__.py\n", r
        # `pip install -e .`: the project's link in the system site-packages, its code in /work.
        r = s.exec(command=f"cd /work/proj && {PIP} -e .", timeout_seconds=600)
        assert r.ok and "user installation" not in r.stdout + r.stderr, (r.stdout, r.stderr)
        r = s.exec(command="cd / && python3 -c 'import edit; print(edit.WORD, edit.__file__)' && ls /root/.local")
        assert r.stdout == "editable /work/proj/edit/__init__.py\n" and r.exit_code != 0, r  # nothing in HOME


def test_writes_anywhere_land_in_the_sandbox_and_never_in_the_image(tpl):
    client, handle = tpl
    with client.session(handle) as s, client.session(handle) as other:
        script = "printf '#!/bin/sh\\necho ran x\\n' > /usr/local/bin/x && chmod +x /usr/local/bin/x && x"
        r = s.exec(command=script)
        assert r.ok and r.stdout == "ran x\n", r
        assert s.exec(command="echo 'nameserver 192.0.2.1' > /etc/resolv.conf && cat /etc/resolv.conf").stdout == "nameserver 192.0.2.1\n"
        # An apt-style drop into a new directory of the image's tree.
        assert s.exec(command="mkdir -p /usr/share/doc/drop && echo d > /usr/share/doc/drop/copyright").ok
        # Deleting an image file hides it from this sandbox only.
        assert s.exec(command="rm /etc/os-release && test ! -e /etc/os-release").ok
        r = other.exec(command="test -e /etc/os-release && test ! -e /usr/local/bin/x && test ! -e /usr/share/doc/drop")
        assert r.ok, r
        assert "overlay / overlay rw" in s.exec(command="cat /proc/mounts").stdout
        # The host may upload there too; the engine's own files stay a read-only mount, and say so.
        s.upload_bytes("/usr/local/share/up.txt", b"uploaded\n")
        assert s.exec(command="cat /usr/local/share/up.txt").stdout == "uploaded\n"
        with pytest.raises(InvalidArgument, match="read-only mount over the sandbox's writable root"):
            s.upload_bytes("/opt/collimate/x", b"x")
        # The copy-up layer is in the sandbox's disk quota.
        before = s.disk_usage()["bytes"]
        assert s.exec(command="head -c 4194304 /dev/zero > /usr/local/share/blob").ok
        assert s.disk_usage()["bytes"] - before >= 4 << 20
    # A fresh sandbox starts from the image again.
    with client.session(handle) as s:
        assert s.exec(command="test -e /etc/os-release && test ! -e /usr/local/bin/x").ok


def test_past_the_quota_a_write_to_the_root_is_enospc(tpl):
    client, handle = tpl
    with client.session(handle, disk_quota="8M") as s:
        r = s.exec(code="open('/usr/local/big', 'wb').write(bytes(16 << 20))")
        assert "OSError: [Errno 28] No space left on device" in r.stderr, (r, s.disk_usage())
        assert s.disk_usage()["bytes"] <= 8 << 20
        # The sandbox goes on; freeing the file frees the quota.
        assert s.exec(command="rm /usr/local/big && echo ok > /usr/local/small && cat /usr/local/small").stdout == "ok\n"


def test_forks_inherit_the_layer_and_diverge_and_reset_drops_it(tpl):
    client, handle = tpl
    with client.session(handle) as s:
        assert s.exec(command="echo parent > /usr/local/f && rm /etc/os-release").ok
        with s.fork_group(2) as grp:
            for i, c in enumerate(grp):
                r = c.exec(command="cat /usr/local/f && test ! -e /etc/os-release")
                assert r.ok and r.stdout == "parent\n", r
                assert c.exec(command=f"echo child{i} > /usr/local/f && touch /usr/local/only{i}").ok
            for i, c in enumerate(grp):
                r = c.exec(command="cat /usr/local/f; ls /usr/local | grep only")
                assert r.stdout == f"child{i}\nonly{i}\n", r
        r = s.exec(command="cat /usr/local/f; ls /usr/local | grep -c only")
        assert r.stdout == "parent\n0\n", r
        s.reset()
        r = s.exec(command="test ! -e /usr/local/f && test -e /etc/os-release")
        assert r.ok, r


def test_a_baked_template_keeps_what_its_ready_step_installed(tpl):
    client, handle = tpl
    check = "cd / && python3 -c 'import bakedpkg; print(bakedpkg.WHERE, bakedpkg.__file__)'"
    with client.session(handle) as s:
        r = s.exec(command=check)
        assert r.ok and r.stdout == f"baked {SITE}/bakedpkg/__init__.py\n", r
        assert s.exec(command="rm -r /usr/local/lib/python3.11/dist-packages/bakedpkg").ok
        assert s.exec(command=check).exit_code == 1
        s.reset()  # back to the template, which has it
        assert s.exec(command=check).ok




def test_an_interpreter_replaced_after_a_timeout_keeps_the_layer(tpl):
    """An exec that times out and whose interpreter ignores SIGINT: a fresh interpreter from the
    template over the sandbox's current files (docs/sessions.md), the copy-up layer included."""
    client, handle = tpl
    with client.session(handle) as s:
        assert s.exec(command="echo kept > /usr/local/kept && rm /etc/os-release").ok
        r = s.exec(code="import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass", timeout_seconds=1)
        assert r.timed_out and "fresh interpreter" in r.note, r
        after = s.exec(command="cat /usr/local/kept && test ! -e /etc/os-release && echo more >> /usr/local/kept")
        assert after.interpreter_restarted and after.stdout == "kept\n", after
        assert s.exec(command="cat /usr/local/kept").stdout == "kept\nmore\n"
