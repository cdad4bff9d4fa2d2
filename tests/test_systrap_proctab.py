"""The sandbox's process table on systrap (docs/systrap.md, vmm/systrap/proctree.rs), through the
public SDK with connect(platform="systrap") and the catalog "python" template's own Debian
programs (bash, coreutils' sleep, CPython): `/proc` lists the sandbox's processes and none of the
host's (what procps and psutil read), kill reaches a sibling, `os.killpg` a whole group, bash's
`kill %1` ends a background job.

procps's ps/pgrep and coreutils' timeout themselves are run by the engine tests
(crates/engine/tests/systrap_proctab.rs). A program copied or built into a sandbox's /work or
/tmp runs there (on systrap those tmpfs mounts are not noexec: the stub maps program files
executable).
"""

from __future__ import annotations

import json

import pytest

from platforms import systrap_client


@pytest.fixture(scope="module")
def client():
    return systrap_client()


@pytest.fixture
def s(client):
    with client.session("python") as s:
        yield s


def sh(s, command: str):
    r = s.exec(command=command, timeout_seconds=120)
    assert r.platform == "systrap"
    return r


PROC = r"""
import json, os, subprocess, time
job = subprocess.Popen(["/bin/sh", "-c", "sleep 300; : marker-arg"])
def table():
    rows = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{d}/stat").read()
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        rows[int(d)] = {"comm": stat[stat.index("(") + 1:stat.rindex(")")],
                        "ppid": int(stat[stat.rindex(")") + 2:].split()[1]),
                        "argv": [a.decode() for a in cmd if a][:6]}
    return rows
for _ in range(2000):
    rows = table()
    if any(r["comm"] == "sleep" for r in rows.values()):
        break
    time.sleep(0.01)
print(json.dumps({"me": os.getpid(), "job": job.pid, "rows": rows,
                  "status": open(f"/proc/{job.pid}/status").read().splitlines()[0],
                  "cwd": os.readlink(f"/proc/{job.pid}/cwd")}))
job.kill(); job.wait()
"""


def test_proc_lists_the_sandboxs_processes_only(s):
    s.upload_bytes("/work/proc.py", PROC.encode())
    r = sh(s, "cd /work && python3 proc.py")
    assert r.exit_code == 0, r.stdout + r.stderr
    i = json.loads(r.stdout.strip().splitlines()[-1])
    rows = {int(k): v for k, v in i["rows"].items()}
    assert rows[1]["comm"] == "python3", rows  # the agent
    assert rows[i["me"]]["ppid"] == 1 and rows[i["me"]]["argv"] == ["python3", "proc.py"], rows
    assert rows[i["job"]] == {"comm": "sh", "ppid": i["me"], "argv": ["/bin/sh", "-c", "sleep 300; : marker-arg"]}, rows
    sleep = [p for p, v in rows.items() if v["argv"] == ["sleep", "300"]]
    assert len(sleep) == 1 and rows[sleep[0]]["ppid"] == i["job"], rows
    assert i["status"] == "Name:\tsh" and i["cwd"] == "/work", i
    # The sandbox's processes only: a handful of small guest pids, nothing of the host's.
    assert len(rows) <= 6 and max(rows) < 100, rows


def test_kill_of_a_sibling(s):
    # The sleep and the sh are both bash's children: a sibling's kill (ESRCH before).
    r = sh(s, "bash -c 'sleep 300 & A=$!; sh -c \"kill $A && echo sent\"; wait $A; echo rc=$?'")
    assert (r.exit_code, r.stdout) == (0, "sent\nrc=143\n"), r.stdout + r.stderr


KILLPG = r"""
import os, signal, subprocess, time
# A group of its own: a shell with two background sleeps; os.killpg ends all three.
p = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
def members():
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(f[2]) == p.pid and f[0] != "Z":
            out.append(int(d))
    return out
for _ in range(2000):
    if len(members()) == 3:
        break
    time.sleep(0.01)
print(len(members()), os.getpgid(p.pid) == p.pid)
os.killpg(p.pid, signal.SIGTERM)
print(p.wait())
for _ in range(2000):
    if not members():
        break
    time.sleep(0.01)
print(members())
"""


def test_os_killpg_ends_a_group(s):
    s.upload_bytes("/work/killpg.py", KILLPG.encode())
    r = sh(s, "python3 /work/killpg.py")
    assert (r.exit_code, r.stdout) == (0, "3 True\n-15\n[]\n"), r.stdout + r.stderr


def test_bash_job_control_kill_percent_one(s):
    r = sh(s, "bash -c 'sleep 100 & kill %1; wait; echo done $?; sleep 100 & kill %1; wait %1; echo rc=$?'")
    assert (r.exit_code, r.stdout) == (0, "done 0\nrc=143\n"), r.stdout + r.stderr


def test_a_program_copied_into_work_and_tmp_runs(s):
    # A binary in the sandbox's own tmpfs (an SWE task's build output, a copied tool): on main it
    # died by SIGSEGV, its segments refused as PROT_EXEC on a noexec mount.
    r = sh(s, "cp /usr/bin/python3 /work/py && cp /bin/bash /tmp/b && /work/py -c 'print(\"built\", 6 * 7)' && /tmp/b -c 'echo ok from tmp'")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "built 42\nok from tmp\n"
