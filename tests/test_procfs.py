"""/proc as a Linux user expects it, for the sandbox's own processes (issue 31, items 3 and 5),
with Debian's own tools in a BYO image: procps (`ps aux`, `ps -ef`, `pgrep -f`), psutil (its
manylinux wheel from PyPI, C extension included) and GNU tar extracting directories (glibc 2.36's
fchmodat(AT_SYMLINK_NOFOLLOW) chmods "/proc/self/fd/N" of an O_PATH descriptor).

The image is the catalog python rootfs plus what `RUN apt-get install -y procps` adds, plus
psutil's wheel unpacked into /usr/local/lib/python3.11/dist-packages (the .debs and the wheel are
downloaded once into the usual caches; never in git). Processes are the sandbox's own: guest pids
from 1, the agent (pid 1) and what a command starts; nothing of the host's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from collimate_core import EmbeddedClient, Sandbox, Template
from collimate_core.templates import cache as _cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from imagefixtures import Layer, debian_layer, write_oci_layout  # noqa: E402

HAVE_KVM = os.path.exists("/dev/kvm") and bool(os.environ.get("COLLIMATE_ROOTFS"))
pytestmark = [pytest.mark.kvm,
              pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm and COLLIMATE_ROOTFS (a built rootfs)")]

PSUTIL = "psutil==7.2.2"
SITE = "usr/local/lib/python3.11/dist-packages"


def psutil_wheel() -> Path:
    """psutil's manylinux wheel for CPython 3.11 (downloaded once into the cache's wheels/)."""
    wheels = _cache.cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("psutil-7.2.2-*manylinux*x86_64*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.11", "--implementation", "cp", "--platform", "manylinux2014_x86_64", "-d", str(wheels), PSUTIL]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        found = sorted(wheels.glob("psutil-7.2.2-*manylinux*x86_64*.whl"))
        if not found:
            pytest.skip(f"could not download {PSUTIL}'s wheel: {r.stderr[-500:]}")
    return found[-1]


def wheel_layer(wheel: Path, tmp: Path) -> bytes:
    """The layer `pip install WHEEL` adds: the wheel's files under the image's site-packages."""
    root = tmp / "wheel-root"
    site = root / SITE
    site.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    for p in site.rglob("*.so"):
        p.chmod(0o755)
    return Layer().tree(root).bytes()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A cache of this file's own with the image baked as template "procfs"."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        pytest.skip("needs Debian's apt-get and dpkg to add procps to the image")
    cache = tmp_path_factory.mktemp("procfs-cache")
    base_root = Path(os.environ["COLLIMATE_ROOTFS"])
    base = Layer().tree(base_root, skip=(".collimate-rootfs.json",)).bytes()
    procps = debian_layer(["procps"], base_root, _cache.deb_dir(_cache.cache_dir()))
    wheel = wheel_layer(psutil_wheel(), tmp_path_factory.mktemp("psutil"))
    (cache / "images").mkdir()
    write_oci_layout(cache / "images" / "procfs", [base, procps, wheel],
                     {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "IMAGE_VAR=from-image"], "WorkingDir": "/work"},
                     ref_name="1.0")
    c = EmbeddedClient(cache=cache)
    try:
        st = Template.bake(c, name="procfs", image="procfs:1.0").wait(900)
        assert st.phase == "Live", (st.error, st.log[-4000:])
        yield c
    finally:
        c.close()


@pytest.fixture
def sb(client):
    with Sandbox("procfs", client=client) as s:
        yield s


def sh(sb, command: str, **kw):
    return sb.exec(command=command, timeout_seconds=kw.pop("timeout_seconds", 120), **kw)


# The image's /bin/sh is busybox, whose shell runs its own ps as an applet: procps's is called by
# its path. A background job with a recognisable command line (a shell, which waits for its sleep child),
# which the foreground part looks for (by a pattern that does not match the command's own line).
SLEEPER = "M=marker; sh -c \"sleep 300; : $M-arg\" & "


def test_ps_aux_and_ps_ef_list_the_sandboxs_processes(sb):
    r = sh(sb, SLEEPER + "$PS aux; echo ===; $PS -ef; echo ===; $PS -o pid=,ppid=,comm= -p $$; echo ===; echo $$; kill %1",
           env={"PS": "/usr/bin/ps"})
    assert r.exit_code == 0, r.stdout + r.stderr
    aux, ef, me, shell = r.stdout.split("===\n")
    lines = aux.splitlines()
    assert lines[0].split()[:4] == ["USER", "PID", "%CPU", "%MEM"], aux
    rows = {int(l.split()[1]): l for l in lines[1:]}
    assert 1 in rows and "python3" in rows[1], aux  # the agent, guest pid 1
    job = [l for l in lines if l.endswith("sh -c sleep 300; : marker-arg")]
    assert len(job) == 1 and job[0].split()[0] == "root", aux
    assert len([l for l in lines if l.endswith(" sleep 300")]) == 1, aux
    assert any(l.split()[10:] == ["/usr/bin/ps", "aux"] for l in lines[1:]), aux
    # Only the sandbox's processes: a handful of small guest pids, none of the host's.
    assert len(rows) <= 8 and max(rows) < 100, aux
    ef_lines = ef.splitlines()
    assert ef_lines[0].split()[:3] == ["UID", "PID", "PPID"], ef
    pids = {int(l.split()[1]): int(l.split()[2]) for l in ef_lines[1:]}
    sh_pid = int(shell.strip())
    assert pids[sh_pid] == 1, ef  # the command's shell is the agent's child
    job_pid = next(int(l.split()[1]) for l in ef_lines if l.endswith("sh -c sleep 300; : marker-arg"))
    assert pids[job_pid] == sh_pid, ef  # the background job is the command's shell's child
    sleep_row = next(l for l in ef_lines if l.endswith(" sleep 300"))
    assert int(sleep_row.split()[2]) == job_pid, ef  # and its sleep the job's
    assert me.split() == [str(sh_pid), "1", "sh"], me


def test_pgrep_finds_by_full_command_line(sb):
    r = sh(sb, SLEEPER + "echo $!; echo ===; $PG -f '300; : marke[r]-arg'; echo ===; $PG -x sleep; echo ===; "
                         "$PG -P $!; echo ===; $PG -f 'no-such-proces[s]'; echo rc=$?; kill %1", env={"PG": "/usr/bin/pgrep"})
    assert r.exit_code == 0, r.stdout + r.stderr
    job, full, exact, children, none = r.stdout.split("===\n")
    assert full.split() == job.split(), r.stdout  # the job's shell, by its command line
    assert len(exact.split()) == 1 and exact.split() == children.split(), r.stdout  # its sleep, by name
    assert none.strip() == "rc=1", r.stdout


PSUTIL_PROGRAM = r"""
import json, os, subprocess, sys, time
import psutil
child = subprocess.Popen(["sleep", "300"], env={"PATH": "/usr/bin:/bin", "CHILD_VAR": "x"})
time.sleep(0.2)
me = psutil.Process()
kids = me.children()
c = psutil.Process(child.pid)
info = {
    "pid": me.pid, "getpid": os.getpid(), "ppid": me.ppid(), "name": me.name(),
    "cmdline": me.cmdline(), "cwd": me.cwd(), "exe": me.exe(), "username": me.username(),
    "uids": list(me.uids()), "status": me.status(), "threads": me.num_threads(),
    "rss": me.memory_info().rss, "vms": me.memory_info().vms,
    "created_after_boot": me.create_time() >= psutil.boot_time(),
    "created_not_in_future": me.create_time() <= time.time() + 1,
    "child_created_after": c.create_time() >= me.create_time(),
    "kids": [k.pid for k in kids], "child": child.pid, "child_ppid": c.ppid(), "child_name": c.name(),
    "child_cmdline": c.cmdline(), "child_env": c.environ().get("CHILD_VAR"),
    "pids": psutil.pids(), "exists": psutil.pid_exists(child.pid), "host_pid": psutil.pid_exists(999999),
    "iter": sorted(p.info["name"] for p in psutil.process_iter(["name"])),
}
child.kill(); child.wait()
print(json.dumps(info))
"""


def test_psutil_sees_itself_and_its_child(sb):
    sb.upload_bytes("/work/ps.py", PSUTIL_PROGRAM.encode())
    r = sh(sb, "cd /work && python3 ps.py extra-arg")
    assert r.exit_code == 0, r.stdout + r.stderr
    i = json.loads(r.stdout.strip().splitlines()[-1])
    # The command's shell ran python3 as its last command, in its own place: the agent's child.
    assert i["pid"] == i["getpid"] and i["ppid"] == 1 and i["name"] == "python3", i
    assert i["cmdline"] == ["python3", "ps.py", "extra-arg"] and i["cwd"] == "/work", i
    assert i["exe"].startswith("/usr/bin/python3") and i["username"] == "root" and i["uids"] == [0, 0, 0], i
    assert i["status"] == "running" and i["threads"] == 1, i
    assert 0 < i["rss"] <= i["vms"], i
    assert i["created_after_boot"] and i["created_not_in_future"] and i["child_created_after"], i
    assert i["kids"] == [i["child"]] and i["child_ppid"] == i["pid"] and i["child_name"] == "sleep", i
    assert i["child_cmdline"] == ["sleep", "300"] and i["child_env"] == "x", i
    assert {1, i["pid"], i["child"]} <= set(i["pids"]) and len(i["pids"]) <= 8, i
    assert i["exists"] and not i["host_pid"], i
    assert {"python3", "sleep"} <= set(i["iter"]), i


def test_tar_extracts_directories_with_their_modes(sb):
    """GNU tar x of an archive of directories: exit 0, the modes set (it chmods each directory
    through fchmodat(AT_SYMLINK_NOFOLLOW), which glibc 2.36 does as an O_PATH open and a chmod of
    /proc/self/fd/N)."""
    r = sh(sb, "set -e; cd /tmp; mkdir -p src/a/b src/c; chmod 750 src/a; chmod 711 src/a/b; chmod 1777 src/c; "
               "echo hi > src/a/b/f; chmod 640 src/a/b/f; tar cf t.tar src; rm -rf src; tar xf t.tar; "
               "python3 -c 'import os, sys; [print(oct(os.lstat(p).st_mode & 0o7777)[2:], p) for p in sys.argv[1:]]' "
               "src src/a src/a/b src/c src/a/b/f; cat src/a/b/f")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "Cannot change mode" not in r.stderr, r.stderr
    assert r.stdout.splitlines() == ["755 src", "750 src/a", "711 src/a/b", "1777 src/c", "640 src/a/b/f", "hi"], r.stdout


def test_commands_get_the_images_environment(sb):
    r = sh(sb, "env", env={"MINE": "1"})
    names = {l.split("=", 1)[0] for l in r.stdout.splitlines() if "=" in l}
    assert "IMAGE_VAR" in names and "MINE" in names, r.stdout
    assert not names & {"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "COLLIMATE_AGENT_ENV"}, r.stdout


SEED = "5eed" * 16


def test_ps_replays(client):
    """With a seed (replay mode: virtual clocks, the processes taking turns), what ps shows of the
    sandbox's processes (pids, parents, start times, sizes, command lines) is the same in every
    sandbox of the template."""
    cmd = ("sleep 300 & /usr/bin/ps -eo pid,ppid,pgid,sid,vsz,rss,lstart,etime,stat,args; "
           "tr '\\0' ' ' < /proc/$!/cmdline; cat /proc/$!/statm /proc/1/stat; kill %1")
    outs = []
    for _ in range(3):
        with Sandbox("procfs", client=client) as s:
            r = s.exec(command=cmd, timeout_seconds=120, seed=SEED)
            assert r.exit_code == 0, r.stdout + r.stderr
            outs.append(r.stdout)
    assert "sleep 300" in outs[0] and "/usr/bin/ps -eo" in outs[0], outs[0]
    assert outs[1] == outs[0] and outs[2] == outs[0], outs
