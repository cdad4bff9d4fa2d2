"""Bring-your-own-image templates: images read offline and verified, layers unpacked faithfully,
Template.bake to Live or Failed, the ready state, the lifecycle, restarts.

The images are built here in Python (tests/imagefixtures.py): a python image from the python
template's root filesystem (COLLIMATE_ROOTFS) plus app layers, and busybox-only images (the static
busybox of that tree). The first group needs no KVM.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from collimate_core import (
    EmbeddedClient,
    InvalidArgument,
    NotFoundError,
    Ready,
    Sandbox,
    Template,
)
from collimate_core.templates import bake as _bake, oci as _oci
from imagefixtures import (
    SLOWMOD,
    Layer,
    busybox_layer,
    corrupt_blob,
    image_config,
    sha256,
    tar_dir,
    write_docker_save,
    write_oci_layout,
)

HAVE_KVM = os.path.exists("/dev/kvm")
kvm = [pytest.mark.kvm, pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")]
SEED = "c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00"


def unpack(tmp: Path, layers: list[bytes], config: dict | None = None, **kw) -> Path:
    """Write an OCI layout of `layers`, open and verify it, unpack it; the tree."""
    info = write_oci_layout(tmp / "layout", layers, config, **kw)
    img = _oci.open_image(tmp / "layout")
    try:
        assert img.digest == info["manifest"]
        root, created = _oci.build_rootfs(img, tmp / "cache")
    finally:
        img.close()
    assert created
    return root


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


# --- layers: whiteouts, opaque directories, links, modes ---------------------------------------


def test_whiteouts_remove_what_lower_layers_made(tmp_path):
    lower = (Layer().dir("etc").file("etc/keep", b"k").file("etc/gone", b"g")
             .dir("var").dir("var/cache").file("var/cache/a", b"a").dir("var/cache/sub").file("var/cache/sub/b", b"b")
             .symlink("etc/link", "keep").bytes())
    upper = (Layer().whiteout("etc/gone").whiteout("var/cache").whiteout("etc/link")
             .whiteout("etc/never-existed").file("etc/new", b"n").bytes())
    root = unpack(tmp_path, [lower, upper])
    assert (root / "etc/keep").read_bytes() == b"k"
    assert (root / "etc/new").read_bytes() == b"n"
    assert not os.path.lexists(root / "etc/gone")
    assert not os.path.lexists(root / "etc/link")  # a whiteout removes a symlink, not its target
    assert not os.path.lexists(root / "var/cache")  # a whole directory
    assert (root / "var").is_dir()
    # Whiteout files themselves never appear.
    assert not [p for p in root.rglob(".wh.*")]


def test_opaque_directory_hides_lower_contents_only(tmp_path):
    lower = (Layer().dir("app").file("app/old1", b"1").dir("app/olddir").file("app/olddir/x", b"x")
             .dir("app/kept").file("app/kept/lower", b"L").file("other", b"o").bytes())
    # The opaque marker comes after entries of the same layer: those stay, lower ones go, also
    # below a directory this layer re-creates.
    upper = (Layer().dir("app").dir("app/kept").file("app/kept/upper", b"U").file("app/new", b"N")
             .opaque("app").bytes())
    third = Layer().file("app/olddir-again", b"3").bytes()
    root = unpack(tmp_path, [lower, upper, third])
    assert sorted(os.listdir(root / "app")) == ["kept", "new", "olddir-again"]
    assert os.listdir(root / "app/kept") == ["upper"]
    assert (root / "other").read_bytes() == b"o"


def test_symlinks_are_kept_verbatim_and_never_followed_out(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    lower = (Layer().dir("usr").dir("usr/bin").file("usr/bin/tool", b"#!/bin/sh\n", 0o755)
             .symlink("bin", "usr/bin")  # usrmerge style
             .symlink("abs", "/usr/bin/tool").symlink("rel", "../usr/bin/tool")
             .symlink("dangling", "/no/such")
             .symlink("escape", "../../../../" + str(outside).lstrip("/"))
             .symlink("escape-abs", str(outside)).bytes())
    # Writing through symlinks resolves them inside the tree, as the guest would see them.
    upper = (Layer().file("bin/added", b"via link", 0o755).file("escape/evil", b"x")
             .file("escape-abs/evil", b"x").bytes())
    root = unpack(tmp_path, [lower, upper])
    assert os.readlink(root / "abs") == "/usr/bin/tool"  # absolute targets stay as the image has them
    assert os.readlink(root / "rel") == "../usr/bin/tool"
    assert os.readlink(root / "dangling") == "/no/such"
    assert os.readlink(root / "bin") == "usr/bin"
    assert (root / "usr/bin/added").read_bytes() == b"via link"
    assert os.listdir(outside) == []  # nothing escaped
    assert (root / str(outside).lstrip("/") / "evil").read_bytes() == b"x"
    tree = _oci.Tree(root)
    assert tree.resolve("/abs") == str(root / "usr/bin/tool")
    assert tree.resolve("/bin/tool") == str(root / "usr/bin/tool")
    assert tree.find_program("tool", "/bin") == "/bin/tool"


def test_hard_links_share_an_inode(tmp_path):
    lower = Layer().dir("data").file("data/orig", b"same bytes", 0o640).bytes()
    upper = (Layer().hardlink("data/link-to-lower", "data/orig")
             .file("data/new", b"new").hardlink("data/link-to-same-layer", "./data/new").bytes())
    root = unpack(tmp_path, [lower, upper])
    a, b = os.stat(root / "data/orig"), os.stat(root / "data/link-to-lower")
    assert a.st_ino == b.st_ino and a.st_nlink == 2
    assert os.stat(root / "data/new").st_ino == os.stat(root / "data/link-to-same-layer").st_ino
    assert (root / "data/link-to-lower").read_bytes() == b"same bytes"


def test_file_modes_ownership_and_special_files(tmp_path):
    layer = (Layer().dir("bin").file("bin/suid", b"s", 0o4755).file("bin/sgid", b"g", 0o2711)
             .file("secret", b"x", 0o600).file("script", b"#!/bin/sh\n", 0o755)
             .dir("sticky", 0o1777).dir("locked", 0o500).file("locked/inside", b"i", 0o444)
             .file("owned", b"o", 0o644, uid=1000, gid=1001)
             .fifo("pipe", 0o620).chardev("dev/console").bytes())
    # A later layer writes into the read-only directory: modes are applied last.
    upper = Layer().file("locked/later", b"l").bytes()
    root = unpack(tmp_path, [layer, upper])
    assert mode(root / "bin/suid") == 0o4755
    assert mode(root / "bin/sgid") == 0o2711
    assert mode(root / "secret") == 0o600
    assert mode(root / "script") == 0o755
    assert mode(root / "sticky") == 0o1777
    assert mode(root / "locked") == 0o500
    assert (root / "locked/later").read_bytes() == b"l"
    assert stat.S_ISFIFO(os.lstat(root / "pipe").st_mode) and mode(root / "pipe") == 0o620
    assert not os.path.lexists(root / "dev/console")  # device nodes: the engine serves /dev
    if os.geteuid() == 0:
        st = os.lstat(root / "owned")
        assert (st.st_uid, st.st_gid) == (1000, 1001)
    meta = json.loads((root / _oci.MARKER).read_text())
    assert meta["stats"]["skipped_devices"] == 1
    # The mount points the engine needs are there.
    for d in ("work", "tmp", "dev", "proc", "opt/collimate"):
        assert (root / d).is_dir(), d


@pytest.mark.parametrize(
    "layer, message",
    [
        (lambda: Layer().file("/etc/abs", b"x").bytes(), "absolute path"),
        (lambda: Layer().file("a/../../evil", b"x").bytes(), "climbs out"),
        (lambda: Layer().hardlink("link", "../../etc/passwd").bytes(), "unsafe target"),
        (lambda: Layer().hardlink("link", "missing").bytes(), "does not exist"),
    ],
    ids=["absolute", "dotdot", "hardlink-out", "hardlink-missing"],
)
def test_unsafe_entries_are_refused_and_nothing_is_left(tmp_path, layer, message):
    write_oci_layout(tmp_path / "layout", [layer()])
    img = _oci.open_image(tmp_path / "layout")
    with pytest.raises(_oci.ImageError, match=message):
        _oci.build_rootfs(img, tmp_path / "cache")
    img.close()
    assert [p.name for p in _oci.rootfs_dir(tmp_path / "cache").iterdir()] == []


def test_gzip_layers_and_docker_save_give_the_same_tree(tmp_path):
    layers = [Layer().dir("etc").file("etc/os-release", b"ID=test\n").bytes(),
              Layer().file("etc/extra", b"e").whiteout("etc/os-release").bytes()]
    cfg = {"Env": ["A=1"], "Cmd": ["/bin/sh"]}
    oci = write_oci_layout(tmp_path / "oci", layers, cfg, compress=True)
    docker = write_docker_save(tmp_path / "img.tar", layers, cfg, repo_tags=["img:1.0"])
    assert oci["config"] == docker["config"]  # the same image id
    a = _oci.open_image(tmp_path / "oci")
    b = _oci.open_image(tmp_path / "img.tar")
    assert (a.format, b.format) == ("oci-layout", "docker-save")
    assert a.id == b.id and b.digest == b.id and a.digest == oci["manifest"]
    assert b.names == ["img:1.0"] and b.image_config.env == ["A=1"]
    ra, created_a = _oci.build_rootfs(a, tmp_path / "cache")
    rb, created_b = _oci.build_rootfs(b, tmp_path / "cache")
    assert ra == rb and created_a and not created_b  # cached by image id
    assert sorted(os.listdir(ra / "etc")) == ["extra"]
    a.close()
    b.close()


# --- digests ------------------------------------------------------------------------------------


def test_digests_are_verified(tmp_path):
    base = Layer().dir("etc").file("etc/hostname", b"box\n").bytes()
    info = write_oci_layout(tmp_path / "ok", [base], {"Cmd": ["true"]})

    # The right pin works; a wrong one names both digests.
    img = _oci.resolve(f"{tmp_path}/ok@{info['manifest']}", tmp_path / "store")
    assert img.digest == info["manifest"]
    img.close()
    wrong = "sha256:" + "0" * 64
    with pytest.raises(_oci.ImageError, match="digest mismatch.*" + info["manifest"]):
        _oci.resolve(f"{tmp_path}/ok@{wrong}", tmp_path / "store")
    with pytest.raises(_oci.ImageError, match="not a digest"):
        _oci.resolve(f"{tmp_path}/ok@sha256:abc", tmp_path / "store")
    with pytest.raises(_oci.ImageError, match="unsupported digest algorithm"):
        _oci.check_digest("sha512:" + "0" * 128)

    # A corrupted layer blob: its content no longer hashes to its name.
    write_oci_layout(tmp_path / "badlayer", [base, Layer().file("x", b"y" * 5000).bytes()])
    bad_info = json.loads((tmp_path / "badlayer" / "index.json").read_text())
    manifest = json.loads((tmp_path / "badlayer/blobs/sha256" / bad_info["manifests"][0]["digest"][7:]).read_bytes())
    corrupt_blob(tmp_path / "badlayer", manifest["layers"][1]["digest"])
    img = _oci.open_image(tmp_path / "badlayer")
    with pytest.raises(_oci.ImageError, match=r"layer 2/2 .* does not match its digest"):
        _oci.build_rootfs(img, tmp_path / "cache")
    img.close()

    # A corrupted manifest or config blob.
    write_oci_layout(tmp_path / "badmanifest", [base])
    m = json.loads((tmp_path / "badmanifest/index.json").read_text())["manifests"][0]["digest"]
    corrupt_blob(tmp_path / "badmanifest", m, offset=10)
    with pytest.raises(_oci.ImageError, match="manifest blob .* does not match"):
        _oci.open_image(tmp_path / "badmanifest")

    # A config whose diff_ids do not match the layers (blob digests all consistent).
    cfg = image_config([base], {})
    cfg["rootfs"]["diff_ids"] = [sha256(b"something else")]
    write_oci_layout(tmp_path / "baddiff", [base], raw_config=cfg)
    img = _oci.open_image(tmp_path / "baddiff")
    with pytest.raises(_oci.ImageError, match="diff_id"):
        _oci.build_rootfs(img, tmp_path / "cache")
    img.close()

    # A docker save archive whose layer was altered.
    write_docker_save(tmp_path / "d.tar", [base], {}, repo_tags=["d:1"])
    raw = bytearray((tmp_path / "d.tar").read_bytes())
    i = raw.find(b"box\n")
    raw[i] = ord("f")
    (tmp_path / "d.tar").write_bytes(bytes(raw))
    img = _oci.open_image(tmp_path / "d.tar")
    with pytest.raises(_oci.ImageError, match="does not match its digest"):
        _oci.build_rootfs(img, tmp_path / "cache")
    img.close()
    assert [p.name for p in _oci.rootfs_dir(tmp_path / "cache").iterdir()] == []


def test_references_resolve_in_the_local_store(tmp_path):
    store = tmp_path / "images"
    store.mkdir()
    l1 = Layer().file("one", b"1").bytes()
    l2 = Layer().file("two", b"2").bytes()
    a = write_oci_layout(store / "alpha", [l1], {"Cmd": ["a"]}, ref_name="3.1")  # skopeo oci:alpha:3.1
    write_oci_layout(tmp_path / "b-layout", [l2], {"Cmd": ["b"]}, ref_name="ghcr.io/you/beta:2")
    tar_dir(tmp_path / "b-layout", store / "beta.tar")  # an oci-archive
    d = write_docker_save(store / "gamma.tar", [l1, l2], {"Cmd": ["g"]}, repo_tags=["gamma:latest", "gamma:7"])

    def cmd(ref):
        img = _oci.resolve(ref, store)
        try:
            return img.image_config.cmd[0]
        finally:
            img.close()

    assert cmd("alpha:3.1") == "a"
    assert cmd("alpha") == "a"
    assert cmd(f"alpha@{a['manifest']}") == "a"
    assert cmd(f"docker.io/library/alpha:3.1@{a['manifest']}") == "a"
    assert cmd("ghcr.io/you/beta:2") == "b"
    assert cmd("gamma") == "g" and cmd("gamma:7") == "g"
    assert cmd(f"gamma@{d['config']}") == "g"  # a docker save archive is pinned by its image id
    assert cmd(f"example.com/whatever@{d['config']}") == "g"  # a digest is the content, whatever the name
    assert cmd(str(store / "gamma.tar")) == "g"
    assert cmd(str(store / "alpha") + ":3.1") == "a"  # a layout path with a tag
    with pytest.raises(_oci.ImageError, match="not in the local image store"):
        _oci.resolve("delta", store)
    with pytest.raises(_oci.ImageError, match="no such file"):
        _oci.resolve(str(tmp_path / "nope.tar"), store)

    # A reference that would need a registry pull says how to provide it locally.
    ref = "ghcr.io/you/swe-rollout@sha256:" + "ab" * 32
    with pytest.raises(_oci.ImageError) as e:
        _oci.resolve(ref, store)
    msg = str(e.value)
    assert f"skopeo copy docker://{ref} oci:{store}/swe-rollout:latest" in msg
    assert f"docker save {ref}" in msg and "image=" in msg

    # Several images in one layout: ambiguous without a tag or digest.
    write_oci_layout(tmp_path / "multi", [l1], {"Cmd": ["m1"]}, ref_name="one")
    two = write_oci_layout(tmp_path / "multi", [l2], {"Cmd": ["m2"]}, ref_name="two")
    with pytest.raises(_oci.ImageError, match="several images"):
        _oci.resolve(str(tmp_path / "multi"), store)
    assert cmd(f"{tmp_path}/multi:two") == "m2"
    assert cmd(f"{tmp_path}/multi@{two['manifest']}") == "m2"


def test_platform_and_user(tmp_path):
    passwd = b"root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"
    group = b"root:x:0:\nstaff:x:50:\nwheel:x:10:root,app\n"
    l1 = Layer().dir("etc").file("etc/passwd", passwd).file("etc/group", group).bytes()
    cfg = image_config([l1], {}, arch="arm64")
    write_oci_layout(tmp_path / "arm", [l1], raw_config=cfg)
    with pytest.raises(_oci.ImageError, match="linux/amd64"):
        _oci.open_image(tmp_path / "arm")
    root = unpack(tmp_path, [l1])
    tree = _oci.Tree(root)
    assert _oci.resolve_user(tree, "")["uid"] == 0
    assert _oci.resolve_user(tree, "app") == {"spec": "app", "uid": 1000, "gid": 1000, "name": "app",
                                              "home": "/home/app", "groups": [10, 1000]}
    assert _oci.resolve_user(tree, "app:staff")["gid"] == 50
    assert _oci.resolve_user(tree, "app:staff")["groups"] == [10, 50]
    assert _oci.resolve_user(tree, "4242:7")["groups"] == [7]
    assert _oci.resolve_user(tree, "4242:7")["uid"] == 4242
    with pytest.raises(_oci.ImageError, match="no user named"):
        _oci.resolve_user(tree, "nobody-here")


def test_bake_arguments_are_checked():
    client = EmbeddedClient(cache="/nonexistent-collimate-test")
    with pytest.raises(InvalidArgument):
        Template.bake(client, name="bad name!", image="x")
    with pytest.raises(InvalidArgument, match="catalog"):
        Template.bake(client, name="python", image="x")
    with pytest.raises(InvalidArgument):
        Template.bake(client, name="ok", image="x", ready="import torch")
    with pytest.raises(InvalidArgument):
        Ready(cmd=["ls"])
    with pytest.raises(InvalidArgument):
        Template.bake(client, name="ok", image="x", width=0)


# --- baking (KVM) -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rootfs() -> Path:
    root = os.environ.get("COLLIMATE_ROOTFS")
    if not root:
        if os.environ.get("COLLIMATE_REQUIRE_KVM") == "1":
            pytest.fail("COLLIMATE_ROOTFS is not set: build it with `python3 guest/rootfs/build.py`")
        pytest.skip("no python rootfs (set COLLIMATE_ROOTFS)")
    return Path(root)


@pytest.fixture(scope="module")
def base_layer(rootfs) -> bytes:
    return Layer().tree(rootfs, skip=(".collimate-rootfs.json",)).bytes()


@pytest.fixture(scope="module")
def busybox_base(rootfs) -> bytes:
    return busybox_layer(rootfs / "usr/bin/busybox")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def store(cache) -> Path:
    s = cache / "images"
    s.mkdir(exist_ok=True)
    return s


@pytest.fixture(scope="module")
def client(cache):
    c = EmbeddedClient(cache=cache)
    yield c
    c.close()


APP_ENV = ["PATH=/usr/local/bin:/usr/bin:/bin", "PYTHONPATH=/srv/app", "GREETING=hello from the image"]


@pytest.fixture(scope="module")
def pyapp(base_layer, store) -> dict:
    """The python image: the python rootfs, an app layer with slowmod, Env, WorkingDir, User, Cmd."""
    app = (Layer().dir("srv").dir("srv/app").file("srv/app/slowmod.py", SLOWMOD)
           .file("srv/app/data.txt", b"app data\n").dir("work").file("work/seeded.txt", b"from the image\n")
           .symlink("usr/local/bin/py", "/usr/bin/python3").bytes())
    cfg = {"Env": APP_ENV, "WorkingDir": "/srv/app", "User": "sandbox",
           "Cmd": ["python3", "-c", "print('default cmd ran')"]}
    return write_oci_layout(store / "pyapp", [base_layer, app], cfg, ref_name="1.0")


@pytest.fixture(scope="module")
def toolbox(busybox_base, store) -> dict:
    """A busybox-only image (no Python) with an Entrypoint wrapper, as a docker save archive."""
    extra = Layer().dir("work").file("etc/motd", b"toolbox motd\n").bytes()
    cfg = {"Env": ["PATH=/bin", "TOOL=box"], "Entrypoint": ["/bin/env", "FROM_ENTRYPOINT=yes"],
           "Cmd": ["echo", "default cmd ran"], "WorkingDir": "/work"}
    return write_docker_save(store / "toolbox.tar", [busybox_base, extra], cfg, repo_tags=["toolbox:1.0"])


def describe(pids: set[int]) -> dict[int, str]:
    """pid -> "state cmdline" of processes still there (for assertion messages)."""
    out = {}
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out[pid] = f"{state} {cmd[:200]}"
        except OSError:
            pass  # gone meanwhile
    return out


def disk_state(cache: Path) -> dict:
    troot, rroot = _bake.templates_root(cache), _oci.rootfs_dir(cache)
    return {
        "templates": sorted(p.name for p in troot.glob("*")) if troot.is_dir() else [],
        "rootfs": sorted(p.name for p in rroot.glob("*")) if rroot.is_dir() else [],
        "tmp": sorted(str(p) for p in cache.rglob("*.tmp")),
    }


def runtime_dirs() -> set[str]:
    """The engine's per-sandbox runtime directories (shared by every process on this host)."""
    shm = Path(os.environ.get("COLLIMATE_RUNTIME_DIR") or "/dev/shm/collimate")
    return {p.name for p in shm.glob("vm-*")} if shm.is_dir() else set()


def leaked_runtime_dirs(before: set[str]) -> set[str]:
    """Runtime directories that appeared since `before` and whose VMM process is gone: leaks
    (other processes' live sandboxes come and go meanwhile)."""
    out = set()
    for name in runtime_dirs() - before:
        try:
            os.kill(int(name[3:]), 0)
        except ProcessLookupError:
            out.add(name)
        except (ValueError, PermissionError):
            pass
    return out


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_python_image_bakes_live_with_its_ready_state_and_config(client, pyapp):
    handle = Template.bake(client, name="pyapp", image="pyapp:1.0",
                           ready=Ready(cmd="echo warm > /work/warm.txt", code="import slowmod"), width=2)
    assert handle.phase == "Building" and handle.version == 1
    status = handle.wait(timeout=300)
    assert status.phase == "Live", status.log
    assert status.digest == pyapp["manifest"] and status.image_id == pyapp["config"]
    assert (status.agent, status.seed_ack) == ("python", "verified")
    assert status.user == {"spec": "sandbox", "uid": 1000, "gid": 1000, "name": "sandbox", "home": "/work",
                           "groups": [1000]}
    assert "Ready(code=...) done" in status.log and "Ready(cmd=...) done" in status.log
    with client.session(handle) as sess:
        r = sess.exec(code="import os, sys\nprint('slowmod' in sys.modules, os.getcwd(), os.environ['GREETING'])",
                      seed=SEED)
        assert r.ok and r.stdout == "True /srv/app hello from the image\n", r
        assert r.seed_ack == "verified"
        r = sess.exec(command="cat data.txt /work/warm.txt /work/seeded.txt; echo $HOME; py -c 'print(6*7)'")
        assert r.ok and r.stdout == "app data\nwarm\nfrom the image\n/work\n42\n", r
        r = sess.exec(command="")  # the image's default: Entrypoint (none) + Cmd
        assert r.ok and r.stdout == "default cmd ran\n"
        r = sess.exec(command="echo $EXTRA; pwd", env={"EXTRA": "per-exec"}, cwd="/tmp")
        assert r.stdout == "per-exec\n/tmp\n"
        r = sess.exec(command="exit 3")
        assert r.exit_code == 3
        # The image's User: the agent and what it runs are uid 1000, own what they create, and
        # cannot become root again; the image's own files keep the image's owners.
        r = sess.exec(code=(
            "import os, subprocess\n"
            "open('/work/mine.txt', 'w').close(); os.mkdir('/tmp/d'); os.symlink('mine.txt', '/work/ln')\n"
            "print(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())\n"
            "print([(os.lstat(p).st_uid, os.lstat(p).st_gid) for p in ('/work/mine.txt', '/tmp/d', '/work/ln')])\n"
            "print(os.stat('/work/seeded.txt').st_uid, os.stat('/srv/app/data.txt').st_uid)\n"
            "print(subprocess.run(['sh', '-c', 'id -u; touch /tmp/sh.txt'], capture_output=True, text=True).stdout.strip())\n"
            "print(os.stat('/tmp/sh.txt').st_uid)\n"
            "for f in (lambda: os.setuid(0), lambda: os.chown('/work/mine.txt', 0, 0)):\n"
            "    try: f(); print('allowed')\n"
            "    except PermissionError: print('EPERM')\n"))
        assert r.ok, r
        assert r.stdout.splitlines() == [
            "1000 1000 1000 [1000]", str([(1000, 1000)] * 3), "0 0", "1000", "1000", "EPERM", "EPERM"], r
        with sess.fork_group(2) as grp:  # a forked sandbox's copy of /work keeps the owners
            assert grp[1].exec(code="import os; print(os.stat('/work/mine.txt').st_uid)").stdout == "1000\n"
    with Sandbox("pyapp", client=client) as sb:  # by name
        assert sb.exec(code="import slowmod; print(len(slowmod.PRIMES))").stdout == "148933\n"


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_image_without_python_gets_a_command_only_template(client, toolbox):
    handle = Template.bake(client, name="toolbox", image="toolbox:1.0", ready=Ready(cmd="echo warm > /work/ready"))
    status = handle.wait(timeout=300)
    assert status.phase == "Live", status.log
    assert (status.agent, status.seed_ack) == ("exec", "off")
    assert status.digest == toolbox["config"]  # a docker save archive: its image id
    with client.session("toolbox") as sess:
        r = sess.exec(command="echo $FROM_ENTRYPOINT $TOOL; cat /work/ready /etc/motd; pwd", seed=SEED)
        assert r.ok and r.stdout == "yes box\nwarm\ntoolbox motd\n/work\n", r
        assert r.seed_ack == "off" and r.seed == SEED
        assert sess.exec(command="").stdout == "default cmd ran\n"
        r = sess.exec(command="echo $X; pwd", env={"X": "ünïcode ok"}, cwd="/tmp")
        assert r.stdout == "ünïcode ok\n/tmp\n"
        assert sess.exec(command="exit 7").exit_code == 7
        assert sess.exec(command="no-such-program").exit_code == 127
        r = sess.exec(code="print(1)")
        assert r.exit_code == 127 and "has no Python" in r.stderr
        # State persists across execs of one sandbox, and forks inherit it.
        sess.exec(command="echo state > /work/s")
        with sess.fork_group(2) as grp:
            assert grp.map(lambda i, c: c.exec(command="cat /work/s").stdout) == ["state\n"] * 2


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_image_without_a_shell_splits_commands_into_words(client, busybox_base, tmp_path):
    no_sh = Layer().whiteout("bin/sh").bytes()
    write_oci_layout(tmp_path / "nosh", [busybox_base, no_sh], {"Env": ["PATH=/bin"]})
    status = Template.bake(client, name="nosh", image=str(tmp_path / "nosh")).wait(300)
    assert status.phase == "Live", status.log
    assert "shell: none" in status.log
    with Sandbox("nosh", client=client) as sb:
        r = sb.exec(command="echo 'two  spaces' \"and $dollar\" back\\ slash")
        assert r.ok and r.stdout == "two  spaces and $dollar back slash\n", r


def _bad_images(tmp_path: Path, base: bytes, busybox: bytes) -> dict:
    good = write_oci_layout(tmp_path / "good", [busybox], {"Env": ["PATH=/bin"]})
    write_oci_layout(tmp_path / "corrupt", [busybox, Layer().file("payload", os.urandom(4096)).bytes()],
                     {"Env": ["PATH=/bin"]}, compress=[False, True])
    m = json.loads((tmp_path / "corrupt/index.json").read_text())["manifests"][0]["digest"]
    layer = json.loads((tmp_path / "corrupt/blobs/sha256" / m[7:]).read_bytes())["layers"][1]["digest"]
    corrupt_blob(tmp_path / "corrupt", layer, offset=100)
    write_oci_layout(tmp_path / "noentry", [busybox], {"Env": ["PATH=/bin"], "Entrypoint": ["/usr/local/bin/app"]})
    return {
        "corrupt-layer": (str(tmp_path / "corrupt"), None, ["layer 2/2", "does not match its digest", "corrupt"]),
        "wrong-digest": (f"{tmp_path}/good@sha256:{'1' * 64}", None, ["digest mismatch", good["manifest"]]),
        "missing-entrypoint": (str(tmp_path / "noentry"), None,
                               ["Entrypoint ['/usr/local/bin/app']", "not an executable file in the image"]),
        "ready-fails": (str(tmp_path / "good"), Ready(cmd="echo about to fail; echo oops >&2; exit 3"),
                        ["Ready(cmd=...) exited with status 3", "about to fail", "oops"]),
        "ready-code-needs-python": (str(tmp_path / "good"), Ready(code="import json"), ["has no python3"]),
        "registry-pull": ("ghcr.io/you/swe-rollout@sha256:" + "cd" * 32, None,
                          ["not in the local image store", "skopeo copy docker://ghcr.io/you/swe-rollout@sha256:",
                           "docker save"]),
    }


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_failed_bakes_report_a_readable_log_and_leave_nothing_behind(client, cache, base_layer, busybox_base,
                                                                      tmp_path):
    cases = _bad_images(tmp_path, base_layer, busybox_base)
    before, shm = disk_state(cache), runtime_dirs()
    for case, (image, ready, phrases) in cases.items():
        handle = Template.bake(client, name=f"bad-{case}", image=image, ready=ready)
        status = handle.wait(timeout=300)
        assert status.phase == "Failed", (case, status.log)
        assert status.error and status.error in status.log
        for phrase in phrases:
            assert phrase in status.log, (case, phrase, status.log)
        if case in ("corrupt-layer", "wrong-digest", "registry-pull", "missing-entrypoint"):
            assert "agent:" not in status.log  # failed before any guest ran
        assert disk_state(cache) == before, case
        # No VMM process of the bake is left. (By the pids its log names: other threads of this
        # test process, an earlier module's included, may start processes meanwhile.)
        named = re.findall(r"VMM process(?:es)? (\d+)(?: \([^)]*\) and (\d+))?", status.log)
        vmms = {int(pid) for pair in named for pid in pair if pid}
        assert bool(vmms) == (case == "ready-fails"), (case, status.log)  # the one case that ran a guest
        assert not describe(vmms), case
        assert not leaked_runtime_dirs(shm), case
        with pytest.raises(NotFoundError):
            Sandbox(f"bad-{case}", client=client).start()
        assert Template.get(client, f"bad-{case}").phase == "Failed"  # this process still has the log
        assert f"bad-{case}" not in [t.name for t in Template.list(client)]


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_lifecycle_rebake_list_get_delete(client, cache, busybox_base, tmp_path):
    v1 = write_oci_layout(tmp_path / "v1", [busybox_base, Layer().file("etc/version", b"one\n").bytes()],
                          {"Env": ["PATH=/bin"]})
    v2 = write_oci_layout(tmp_path / "v2", [busybox_base, Layer().file("etc/version", b"two\n").bytes()],
                          {"Env": ["PATH=/bin"]})
    h1 = Template.bake(client, name="life", image=str(tmp_path / "v1"))
    assert h1.wait(300).phase == "Live"
    old = Sandbox("life", client=client).start()
    assert old.exec(command="cat /etc/version").stdout == "one\n"
    old.exec(command="echo dirty > /work/f")

    h2 = Template.bake(client, name="life", image=str(tmp_path / "v2"))
    st2 = h2.wait(300)
    assert (st2.phase, st2.version, h2.version) == ("Live", 2, 2)
    # The old sandbox keeps running on v1, resets to v1, and its files are still there.
    assert old.exec(command="cat /etc/version /work/f").stdout == "one\ndirty\n"
    old.reset()
    r = old.exec(command="cat /etc/version; ls /work")
    assert r.stdout == "one\n", r
    with Sandbox("life", client=client) as new:
        assert new.exec(command="cat /etc/version").stdout == "two\n"
    tdir = _bake._tdir(cache, "life")
    assert (tdir / "v1").is_dir()  # held by the live sandbox
    [st] = [t for t in Template.list(client) if t.name == "life"]
    assert (st.version, st.digest, st.phase) == (2, v2["manifest"], "Live")
    got = Template.get(client, "life")
    assert got.version == 2 and got.status().phase == "Live" and "live: template 'life' v2" in got.status().log
    old.kill()
    client._reaper.submit(lambda: None).result()  # the old sandbox is torn down

    h3 = Template.bake(client, name="life", image=str(tmp_path / "v1"))
    assert h3.wait(300).phase == "Live"
    assert not (tdir / "v1").exists()  # nothing held v1 any more: pruned
    Template.delete(client, "life")
    assert not tdir.exists()
    assert v2["config"][7:] not in [p.name for p in _oci.rootfs_dir(cache).iterdir()]
    with pytest.raises(NotFoundError):
        Template.get(client, "life")
    with pytest.raises(NotFoundError):
        Sandbox("life", client=client).start()
    with pytest.raises(NotFoundError):
        Template.delete(client, "life")
    del v1


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_template_survives_a_restart_and_forks_identical_clones(client, cache, pyapp):
    st = Template.bake(client, name="restart", image="pyapp@" + pyapp["manifest"],
                       ready=Ready(code="import slowmod, random\nTOKEN = random.random()")).wait(300)
    assert st.phase == "Live", st.log
    fresh = EmbeddedClient(cache=cache)  # a new engine: nothing registered, everything from disk
    try:
        assert "restart" not in fresh._templates
        outs = []
        for _ in range(2):
            with Sandbox("restart", client=fresh) as sb:
                r = sb.exec(code="import os, random, sys\nprint(TOKEN, 'slowmod' in sys.modules, random.random(), "
                                 "os.urandom(8).hex())", seed=SEED)
                assert r.ok and r.seed_ack == "verified", r
                outs.append(r.stdout)
        assert outs[0] == outs[1] and " True " in outs[0]
        with Sandbox("restart", client=client) as sb:  # the same template in the first engine
            assert sb.exec(code="print(TOKEN)").stdout.split()[0] == outs[0].split()[0]
    finally:
        fresh.close()


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_env_with_a_catalog_image_bakes_it_in_one_step(client, cache, toolbox):
    with client.env("toolbox:1.0", width=2) as env, env.sandbox() as sess:
        r = sess.exec(command="echo $FROM_ENTRYPOINT; cat /etc/motd")
        assert r.ok and r.stdout == "yes\ntoolbox motd\n"
    assert "toolbox:1.0" in [t.name for t in Template.list(client)]
    with pytest.raises(NotFoundError, match="skopeo copy"):
        with client.env("ghcr.io/you/x@sha256:" + "ef" * 32):
            pass
    with pytest.raises(NotFoundError, match="catalog"):
        client.env("no-such-image", width=1).__enter__()


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_pro_quickstart_bake_snippet_as_written(client, base_layer, store):
    """The seed's "Bake your image" and rollout loop, with the image provided locally as its
    `skopeo copy docker://ghcr.io/you/swe-rollout@sha256:... oci:<store>/swe-rollout:latest` would."""
    app = Layer().dir("srv").dir("srv/app").file("srv/app/slowmod.py", SLOWMOD).bytes()
    pinned = write_oci_layout(store / "swe-rollout", [base_layer, app], {"Env": APP_ENV}, ref_name="latest")
    WIDTH = 8  # the seed uses 64; the shape is the same

    handle = Template.bake(
        client,
        name="swe-rollout",
        image=f"ghcr.io/you/swe-rollout@{pinned['manifest']}",  # pin by digest
        ready=Ready(code="import slowmod"),  # warm state into the artifact
        width=WIDTH,  # how wide you expect to fan out — a hint, not a knob
    )
    status = handle.wait(timeout=600)
    print(status.phase)  # Live
    assert status.phase == "Live", status.log

    def rollout_group(task_cmd: str, candidates: list[str]) -> list[float]:
        with client.session(handle) as sess:
            sess.exec(command=task_cmd, timeout_seconds=120)
            with sess.fork_group(WIDTH) as grp:
                def run(i, child):
                    r = child.exec(code=candidates[i], timeout_seconds=120)
                    return 1.0 if r.ok else 0.0

                return grp.map(run)

    candidates = [f"import slowmod, sys\nassert 'slowmod' in sys.modules\nassert {i} % 3 != 1" for i in range(WIDTH)]
    rewards = rollout_group("echo task > /work/task.txt", candidates)
    assert rewards == [0.0 if i % 3 == 1 else 1.0 for i in range(WIDTH)]
    with client.env("swe-rollout", width=WIDTH) as env, env.sandbox() as sess:
        assert sess.exec(code="import slowmod; print(slowmod.DIGEST[:8])").ok
