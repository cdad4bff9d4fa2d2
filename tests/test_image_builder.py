"""`Image`, the SDK's image builder (python/collimate_core/templates/image.py, docs/templates.md).

Real parts: the python template's Debian root filesystem as the base, Debian's `make` through
apt-get download + dpkg -x, PyPI's pytest wheels through pip on this host, and a bake whose
sandboxes run them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from collimate_rl import Image, InvalidArgument, Template, connect
from collimate_core.templates import cache as _cache
from collimate_core.templates import oci as _oci


def _layer_builds(cache: Path) -> list[dict]:
    return [b for b in _cache.builds(cache) if b.get("kind") == "image-layer"]


def test_bad_steps_say_what_to_do(tmp_path):
    with pytest.raises(InvalidArgument, match="3.11 only"):
        Image.debian_slim("3.12")
    with pytest.raises(InvalidArgument, match="not package names"):
        Image.debian_slim().apt_install("-y")
    with pytest.raises(InvalidArgument, match="at least one"):
        Image.debian_slim().pip_install()
    with pytest.raises(InvalidArgument, match="not a file"):
        Image.debian_slim().add_local_file(tmp_path / "missing", "/work/x")
    with pytest.raises(InvalidArgument, match="absolute"):
        Image.debian_slim().workdir("work")
    with pytest.raises(InvalidArgument, match="starts from a base"):
        Image().build()


def test_layers_are_content_addressed_shared_and_built_offline_once_cached(tmp_path, monkeypatch):
    cache = _cache.cache_dir()
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "a.txt").write_text(f"unique {tmp_path}\n")
    one = Image.debian_slim().pip_install("iniconfig").add_local_dir(tmp_path / "proj", "/work/proj")
    two = Image.debian_slim().add_local_dir(tmp_path / "proj", "/work/proj").env({"X": "1"}).workdir("/work/proj")
    before = len(_layer_builds(cache))
    b1 = one.build()
    made = len(_layer_builds(cache)) - before
    assert made >= 1  # at least the new directory's layer (the others may be cached already)
    b2 = two.build()
    # The directory's layer is the same file for both images: built once, shared.
    assert b1.layers[-1].path == b2.layers[-1].path and b1.layers[-1].digest == b2.layers[-1].digest
    assert b1.layers[0].path == b2.layers[0].path  # the base too
    assert len(_layer_builds(cache)) - before == made
    assert b2.config["config"]["WorkingDir"] == "/work/proj" and "X=1" in b2.config["config"]["Env"]
    # Offline: no index, no proxy reachable; the cached layers build the same image again.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    assert one.build().digest == b1.digest
    assert len(_layer_builds(cache)) - before == made
    # A changed file is a new layer.
    (tmp_path / "proj" / "a.txt").write_text("changed\n")
    assert two.build().layers[-1].digest != b2.layers[-1].digest


def test_export_oci_is_an_image_the_oci_reader_opens(tmp_path):
    (tmp_path / "f").write_bytes(b"payload\n")
    image = Image.debian_slim().add_local_file(tmp_path / "f", "/opt/data/f", mode=0o600).env({"K": "v"})
    out = image.export_oci(tmp_path / "layout")
    again = image.export_oci(tmp_path / "layout2")
    assert json.loads((out / "index.json").read_text()) == json.loads((again / "index.json").read_text())
    img = _oci.open_image(out)
    try:
        assert img.image_config.env_dict()["K"] == "v"
        _oci.verify_layers(img)
        root = tmp_path / "root"
        root.mkdir()
        _oci.unpack(img, root)
    finally:
        img.close()
    f = root / "opt" / "data" / "f"
    assert f.read_bytes() == b"payload\n" and (f.stat().st_mode & 0o777) == 0o600
    assert (root / "usr" / "bin" / "python3").exists() and os.path.islink(root / "bin")


@pytest.mark.kvm
@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")
def test_a_baked_builder_image_runs_debian_and_pypi_programs(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('hello from the image')\n")
    image = (
        Image.debian_slim()
        .apt_install("make")
        .pip_install("pytest")
        .add_local_file(script, "/work/hello.py")
        .env({"GREETING": "hi"})
        .workdir("/work")
    )
    client = connect()
    handle = Template.bake(client, name="test-image-builder", image=image)
    st = handle.wait(timeout=900)
    assert st.phase == "Live", st.log
    with client.session(handle) as s:
        r = s.exec(command="pwd; echo $GREETING; make --version | head -1; pytest --version; python3 hello.py")
        assert r.ok, r
        assert r.stdout.splitlines()[:3] == ["/work", "hi", "GNU Make 4.3"], r.stdout
        assert r.stdout.splitlines()[3].startswith("pytest "), r.stdout
        assert r.stdout.splitlines()[4] == "hello from the image"
    Template.delete(client, "test-image-builder")


@pytest.mark.kvm
@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")
def test_home_is_writable_so_pip_installs_land_there(tmp_path):
    """With a read-only root (`read_only_root=True`; the default root is writable, see
    tests/test_writable_root.py): `pip install --user`, and `pip install -e .` (pip falls back to the
    user site when the system's is read-only), in a sandbox without network: into HOME, the
    sandbox's own copy of the image's, which a fork inherits and a reset drops."""
    proj = tmp_path / "proj"
    (proj / "greet").mkdir(parents=True)
    (proj / "greet" / "__init__.py").write_text("def hello():\n    return 'hello from greet'\n")
    (proj / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "greet"\nversion = "0.1"\n'
    )
    image = Image.debian_slim().pip_install("pip", "setuptools", "wheel").add_local_dir(proj, "/work/proj")
    client = connect()
    handle = Template.bake(client, name="test-image-builder-home", image=image, read_only_root=True)
    st = handle.wait(timeout=900)
    assert st.phase == "Live", st.log
    pip = "python3 -m pip install --no-index --no-build-isolation --disable-pip-version-check"
    check = "cd / && python3 -c 'import greet; print(greet.hello(), greet.__file__)'"
    try:
        with client.session(handle) as s:
            assert s.exec(command="echo $HOME > ~/written && cat /root/written").stdout == "/root\n"
            r = s.exec(command=f"cd /work/proj && {pip} -e .", timeout_seconds=600)
            assert r.ok and "user installation" in r.stdout + r.stderr, (r.stdout, r.stderr)
            r = s.exec(command=check)
            assert r.ok and r.stdout == "hello from greet /work/proj/greet/__init__.py\n", r
            # Editable: an edit shows at once.
            assert s.exec(command="sed -i 's/hello from/howdy from/' /work/proj/greet/__init__.py").ok
            assert s.exec(command=check).stdout.startswith("howdy from greet")
            with s.fork_group(1) as grp:
                assert grp[0].exec(command=check).stdout.startswith("howdy from greet")
            s.reset()
            assert s.exec(command=check).exit_code == 1  # the install is gone with the reset
            assert s.exec(command="test -e /root/written").exit_code == 1
            r = s.exec(command=f"{pip} --user /work/proj", timeout_seconds=600)
            assert r.ok, (r.stdout, r.stderr)
            r = s.exec(command=check)
            assert r.ok and "/root/.local/lib/python3.11/site-packages/greet/" in r.stdout, r
            # The rest of the root is the image's, read-only, and says so.
            assert "Read-only file system" in s.exec(command="touch /usr/local/x").stderr
            with pytest.raises(InvalidArgument, match="the root is read-only here"):
                s.upload_bytes("/usr/local/x", b"x")
    finally:
        Template.delete(client, "test-image-builder-home")
