"""An SWE-style episode, end to end, on an image from the SDK's builder.

The project is six, from its PyPI sdist (pure Python, its own pytest suite: test_six.py), with
PyPI's pytest. The agent edits files, one command hangs and times out (the edits stay), the
project's tests run, and a fork group of patch candidates is graded by exit code.

On both platforms: kvm bakes a checkpoint; systrap (issue 35) a live zygote of the same image
(sdk/live.py: the image's agent run to its ready point once, sandboxes its clones).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile

import pytest

from collimate_rl import Image, Template, connect
from collimate_core.sdk import platform as pf

PLATFORMS = [
    pytest.param("kvm", marks=[pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]),
    pytest.param("systrap", marks=pytest.mark.skipif(not pf.probe_systrap().available,
                                                     reason="this host does not allow seccomp filters (systrap)")),
]

SDIST = "six==1.17.0"
TEMPLATE = "test-swe-episode"

# The task: six.ensure_str(5) should give "5" (today it raises TypeError).
TASK_TEST = b"""import six


def test_ensure_str_takes_an_int():
    assert six.ensure_str(5) == "5"
"""

# A test that never returns (a hung test in an agent's run).
HANG_TEST = b"""def test_hangs():
    while True:
        pass
"""

# Each candidate is what an agent's patch does to six.py, as Python run in the sandbox.
ANCHOR = "    if type(s) is str:\n        return s\n"


def _insert(lines: str) -> str:
    return (
        f"ANCHOR, ADD = {ANCHOR!r}, {lines!r}\n"
        "src = open('six.py').read()\n"
        "assert ANCHOR in src\n"
        "open('six.py', 'w').write(src.replace(ANCHOR, ANCHOR + ADD, 1))\n"
    )


CANDIDATES = {
    "fix": _insert("    if isinstance(s, int):\n        return str(s)\n"),
    "wrong": _insert("    if isinstance(s, int):\n        return repr(s) + '!'\n"),
    "syntax": "open('six.py', 'a').write('def broken(:\\n')\n",
    # A same-size edit that breaks the suite. The parent's runs left six.py's bytecode in
    # __pycache__, valid while the source's whole-second mtime and size match: the child's edit
    # must land in a later second, or its run tests the unedited module (a wrong reward of 1.0,
    # seen in benches/bench_swe.py before replay runs started at the next whole second).
    "same-size": (
        "OLD, NEW = 'PY3 = sys.version_info[0] == 3', 'PY3 = sys.version_info[0] == 4'\n"
        "src = open('six.py').read()\n"
        "assert OLD in src\n"
        "open('six.py', 'w').write(src.replace(OLD, NEW, 1))\n"
    ),
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp("sdist")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(d)],
        check=True,
    )
    (sdist,) = d.glob("six-*.tar.gz")
    with tarfile.open(sdist) as tf:
        tf.extractall(d, filter="data")
    return d / sdist.name[: -len(".tar.gz")]


@pytest.fixture(scope="module", params=PLATFORMS)
def template(project, request):
    image = Image.debian_slim().pip_install("pytest").add_local_dir(project, "/work/six").workdir("/work/six")
    client = connect(platform=request.param)
    assert client.platform == request.param
    handle = Template.bake(client, name=TEMPLATE, image=image)
    st = handle.wait(timeout=900)
    assert st.phase == "Live", st.log
    yield client, handle
    Template.delete(client, TEMPLATE)


def test_swe_episode(template):
    client, handle = template
    with client.session(handle) as s:
        # The project's own suite passes as shipped.
        base = s.exec(command="python3 -m pytest -q -p no:cacheprovider test_six.py", timeout_seconds=600)
        assert base.platform == client.platform
        assert base.exit_code == 0 and " passed" in base.stdout, (base.stdout[-2000:], base.stderr[-2000:])
        # The agent edits: the task's test, a note in the module, a test file that hangs.
        s.upload_bytes("/work/six/test_task.py", TASK_TEST)
        s.upload_bytes("/work/six/test_hang.py", HANG_TEST)
        assert s.exec(command="sed -i '1i # edited by the agent' six.py").ok
        red = s.exec(command="python3 -m pytest -q -p no:cacheprovider test_task.py", timeout_seconds=600)
        assert red.exit_code == 1 and "TypeError" in red.stdout, red.stdout[-2000:]
        # One command hangs and times out...
        hung = s.exec(command="python3 -m pytest -q -p no:cacheprovider test_hang.py", timeout_seconds=5)
        assert hung.timed_out and hung.exit_code == 124 and not hung.interpreter_died, hung
        # ...and the edits are still there, in a sandbox that still runs the project's tests.
        kept = s.exec(command="head -1 six.py; ls test_task.py test_hang.py")
        assert kept.stdout == "# edited by the agent\ntest_hang.py\ntest_task.py\n" and not kept.interpreter_restarted, kept
        again = s.exec(command="python3 -m pytest -q -p no:cacheprovider test_six.py", timeout_seconds=600)
        assert again.exit_code == 0 and " passed" in again.stdout, again.stdout[-2000:]
        # A fork group of patch candidates, graded by the exit code of the task's and the suite's tests.
        names = list(CANDIDATES)
        with s.fork_group(len(names)) as grp:

            def grade(i, child):
                patched = child.exec(code="import os\nos.chdir('/work/six')\n" + CANDIDATES[names[i]])
                assert patched.ok, (names[i], patched)
                r = child.exec(command="python3 -m pytest -q -p no:cacheprovider test_task.py test_six.py", timeout_seconds=600)
                return 1.0 if r.exit_code == 0 else 0.0

            rewards = grp.map(grade)
        assert dict(zip(names, rewards)) == {"fix": 1.0, "wrong": 0.0, "syntax": 0.0, "same-size": 0.0}
        # The parent is untouched by its children's patches.
        assert s.exec(command="python3 -m pytest -q -p no:cacheprovider test_task.py").exit_code == 1
