"""Image templates on the systrap platform (issue 35; sdk/live.py, templates/bake.py): a BYO image
from the SDK's builder (Debian 12's root filesystem, a local project, Env and WorkingDir) baked on
`connect(platform="systrap")` into a live zygote (the image's agent run through the bake's Ready
steps once; sandboxes are its clones), then used as on kvm: sessions, commands with the image's
tools, uploads and downloads, fork groups, grading, a writable root like a container's; and what
systrap cannot do (a template baked into a kvm snapshot) refused with what to do instead.

Needs seccomp filters (systrap), not /dev/kvm (the refusal test bakes on kvm where it exists).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collimate_rl import (EmbeddedClient, Image, NotFoundError, PlatformUnavailable, Ready, Template, UnitTestReward,
                          connect, grade)
from collimate_core.sdk import platform as pf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from imagefixtures import Layer, busybox_layer, write_docker_save, write_oci_layout  # noqa: E402

pytestmark = pytest.mark.skipif(not pf.probe_systrap().available,
                                reason="this host does not allow seccomp filters (systrap)")

NAME = "test-systrap-image"
MODULE = "def double(x):\n    return 2 * x\n"


@pytest.fixture(scope="module")
def tpl(tmp_path_factory):
    proj = tmp_path_factory.mktemp("proj")
    (proj / "calc.py").write_text(MODULE)
    (proj / "data").mkdir()
    (proj / "data" / "a.txt").write_text("alpha\n")
    image = (Image.debian_slim().add_local_dir(proj, "/srv/proj").workdir("/srv/proj")
             .env({"GREETING": "from-the-image"}))
    client = connect(platform="systrap")
    assert client.platform == "systrap"
    # A Ready step that writes into the image's tree (kept: the root is writable) and one that
    # imports in the agent (kept loaded in every clone).
    handle = Template.bake(client, name=NAME, image=image,
                           ready=Ready(cmd="mkdir -p /usr/local/share/baked && echo ready > /usr/local/share/baked/mark",
                                       code="import calc\nBAKED = calc.double(21)"))
    st = handle.wait(timeout=900)
    assert st.phase == "Live", st.log
    assert "live zygote" in st.log, st.log
    yield client, handle
    Template.delete(client, NAME)


def test_a_session_runs_the_images_tools_env_and_files(tpl):
    client, handle = tpl
    with client.session(handle) as s:
        r = s.exec(command="pwd; echo $GREETING; cat data/a.txt; bash -c 'echo bash $BASH_VERSINFO'; "
                           "cat /usr/local/share/baked/mark")
        assert r.ok and r.platform == "systrap", r
        lines = r.stdout.splitlines()
        assert lines[:3] == ["/srv/proj", "from-the-image", "alpha"] and lines[3].startswith("bash 5"), r
        assert lines[4] == "ready", r
        # The Ready step's code ran in the zygote: its names are there without running it again.
        assert s.exec(code="print(BAKED, calc.double(5))").stdout == "42 10\n"
        # Uploads and downloads; the image's tar packs what was uploaded.
        s.upload_bytes("/work/in.txt", b"uploaded\n")
        r = s.exec(command="cd /work && tar cf out.tar in.txt && tar tf out.tar && cat in.txt")
        assert r.stdout == "in.txt\nuploaded\n", r
        assert s.download("/work/in.txt") == b"uploaded\n"
        assert len(s.download("/work/out.tar")) >= 1024


def test_a_fork_group_starts_from_the_parent_and_diverges(tpl):
    client, handle = tpl
    with client.session(handle) as s:
        assert s.exec(command="echo parent > /work/state && echo v1 > /usr/local/share/version").ok
        s.exec(code="x = 7")
        with s.fork_group(3) as grp:
            outs = grp.map(lambda i, c: c.exec(
                command=f"cat /work/state /usr/local/share/version; echo child{i} > /work/state; cat /work/state").stdout)
            assert outs == [f"parent\nv1\nchild{i}\n" for i in range(3)], outs
            assert grp.map(lambda i, c: c.exec(code=f"print(x + {i})").stdout) == ["7\n", "8\n", "9\n"]
        assert s.exec(command="cat /work/state").stdout == "parent\n"


def test_the_root_is_writable_like_a_containers_and_each_sandbox_has_its_own(tpl):
    client, handle = tpl
    with client.session(handle) as s, client.session(handle) as other:
        script = "mkdir -p /usr/local/bin && printf '#!/bin/sh\\necho ran x\\n' > /usr/local/bin/x && chmod +x /usr/local/bin/x && x"
        r = s.exec(command=script)
        assert r.ok and r.stdout == "ran x\n", r
        assert s.exec(command="rm /etc/os-release && test ! -e /etc/os-release").ok
        r = other.exec(command="test -e /etc/os-release && test ! -e /usr/local/bin/x && cat /usr/local/share/baked/mark")
        assert r.ok and r.stdout == "ready\n", r
        assert "overlay / overlay rw" in s.exec(command="cat /proc/mounts").stdout


def test_a_recycled_sandbox_gets_the_images_writable_root_back(tpl):
    # A sandbox that ends is reset in place and recycled (vmm/systrap/reset.rs): the next one
    # finds the image's root (and the bake's Ready steps) again with a fresh writable layer.
    client, handle = tpl
    t = client._template(NAME)
    client._reaper.submit(lambda: None).result()
    t.drain()
    with client.session(handle) as s:
        pid = s._box.vm.pid
        assert s.exec(command="echo left > /usr/local/share/left && rm /etc/os-release && echo w > /work/w").ok
    end = time.monotonic() + 30
    while not any(vm.pid == pid for vm in list(t.recycled)) and time.monotonic() < end:
        time.sleep(0.05)
    with client.session(handle) as s:
        assert s._box.vm.pid == pid, "not recycled"
        r = s.exec(command="test -e /etc/os-release && test ! -e /usr/local/share/left && test ! -e /work/w "
                           "&& cat /usr/local/share/baked/mark")
        assert r.ok and r.stdout == "ready\n", r
        assert "overlay / overlay rw" in s.exec(command="cat /proc/mounts").stdout
        assert s.exec(command="echo again > /usr/local/share/left && cat /usr/local/share/left").stdout == "again\n"


def test_grading_in_the_image(tpl):
    client, handle = tpl
    spec = UnitTestReward(template=NAME, tests="import calc\nassert solve(3) == calc.double(3) + 1\n")
    rewards = [grade(code, spec, client=client).reward
               for code in ("def solve(x):\n    return 2 * x + 1\n", "def solve(x):\n    return x\n")]
    assert rewards == [1.0, 0.0]


def test_a_read_only_root_is_the_images(tmp_path):
    client = connect(platform="systrap")
    handle = Template.bake(client, name="test-systrap-ro", image=Image.debian_slim(), read_only_root=True)
    try:
        assert handle.wait(timeout=900).phase == "Live"
        with client.session(handle) as s:
            r = s.exec(command="echo x > /etc/x")
            assert r.exit_code != 0 and "Read-only file system" in r.stderr, r
            assert s.exec(command="echo x > /work/x && cat /work/x").stdout == "x\n"
    finally:
        Template.delete(client, "test-systrap-ro")


@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="bakes a kvm snapshot: needs /dev/kvm")
def test_a_template_baked_into_a_kvm_snapshot_is_refused_on_systrap_with_what_to_do():
    kvm = connect(platform="kvm")
    handle = Template.bake(kvm, name="test-systrap-kvm-baked", image=Image.debian_slim())
    try:
        assert handle.wait(timeout=900).phase == "Live"
        systrap = connect(platform="systrap")
        with pytest.raises(PlatformUnavailable, match="not supported on the systrap platform yet") as e:
            with systrap.session("test-systrap-kvm-baked"):
                pass
        assert "Template.bake(client, ...)" in str(e.value) and "platform='kvm'" in str(e.value)
    finally:
        Template.delete(kvm, "test-systrap-kvm-baked")


def test_env_of_an_image_in_the_store_and_an_images_user(tmp_path):
    """`client.env(ref)` bakes an image of the local store live in one step (here one without
    Python: command execs through collimate-exec, its Entrypoint kept); an image's User is who
    the guest runs as; names that are neither say so."""
    root = os.environ.get("COLLIMATE_ROOTFS")
    if not root:
        pytest.skip("no python rootfs (set COLLIMATE_ROOTFS)")
    store = tmp_path / "images"
    store.mkdir()
    extra = Layer().dir("work").file("etc/motd", b"toolbox motd\n").bytes()
    write_docker_save(store / "toolbox.tar", [busybox_layer(Path(root) / "usr/bin/busybox"), extra],
                      {"Env": ["PATH=/bin", "TOOL=box"], "Entrypoint": ["/bin/env", "FROM_ENTRYPOINT=yes"],
                       "WorkingDir": "/work"}, repo_tags=["toolbox:1.0"])
    client = EmbeddedClient(cache=tmp_path, platform="systrap")
    try:
        with client.env("toolbox:1.0") as env, env.sandbox() as sess:
            r = sess.exec(command="echo $FROM_ENTRYPOINT $TOOL; cat /etc/motd; pwd")
            assert r.ok and r.stdout == "yes box\ntoolbox motd\n/work\n" and r.seed_ack == "off", r
        # Another process's prune of the shared cache (its bakes and deletes run one) keeps the
        # root filesystem of this process's live template: its next sandbox still runs.
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                        "from collimate_core.templates import bake; bake._prune(Path(sys.argv[1]))", str(tmp_path)],
                       check=True)
        with client.env("toolbox:1.0") as env, env.sandbox() as sess:
            assert sess.exec(command="cat /etc/motd").stdout == "toolbox motd\n"
        with pytest.raises(NotFoundError, match="skopeo copy"):
            with client.env("ghcr.io/you/x@sha256:" + "ef" * 32):
                pass
        with pytest.raises(NotFoundError, match="no template named 'no-such-image'"):
            client.env("no-such-image").__enter__()
        # A User: the python rootfs has user "sandbox"; the guest runs as it.
        write_oci_layout(store / "asuser", [Layer().tree(Path(root), skip=(".collimate-rootfs.json",)).bytes()],
                         {"Env": ["PATH=/usr/bin:/bin"], "User": "sandbox"}, ref_name="1.0")
        st = Template.bake(client, name="asuser", image="asuser:1.0", ready=Ready(cmd="touch /work/made")).wait(300)
        assert st.phase == "Live" and st.user["name"] == "sandbox", st.log
        with client.session("asuser") as s:
            r = s.exec(code="import os, pwd\nprint(pwd.getpwuid(os.getuid()).pw_name, "
                            "pwd.getpwuid(os.stat('/work/made').st_uid).pw_name)")
            assert r.stdout == "sandbox sandbox\n", r
    finally:
        client.close()
