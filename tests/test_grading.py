"""Reward grading: extract_code, UnitTestReward, PropertyReward, grade, grade_batch, the TRL adapter,
and candidates that try to score without solving."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collimate_rl import (
    InvalidArgument,
    PropertyReward,
    UnitTestReward,
    connect,
    extract_code,
    grade,
    grade_batch,
    trl_reward_func,
)

needs_kvm = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

SORT_TESTS = "assert solve([3,1,2]) == [1,2,3]\nassert solve([]) == []\nassert solve([2,2,1]) == [1,2,2]\n"
GOOD = "def solve(xs):\n    return sorted(xs)\n"


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    return connect()


# --- extract_code -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Sure!\n```python\nprint(1)\n```\n", "print(1)\n"),
        ("```\nprint(2)\n```", "print(2)\n"),
        ("~~~py\nprint(3)\n~~~", "print(3)\n"),
        ("1. Step:\n   ```python\n   x = 4\n   print(x)\n   ```\n", "x = 4\nprint(x)\n"),
        ("```python\na = 1\n```\nthen\n```python\nb = 2\n```", "b = 2\n"),  # the last python block
        ("```bash\nls\n```\n```python\nc = 3\n```\n```text\nout\n```", "c = 3\n"),
        ("<code>d = 4</code>", "d = 4\n"),
        ("e = 5\nprint(e)", "e = 5\nprint(e)\n"),  # no fence, but valid Python
        ("I cannot help with that.", ""),
        ("", ""),
    ],
)
def test_extract_code(completion, expected):
    assert extract_code(completion) == expected


def test_extract_code_rejects_non_text():
    with pytest.raises(InvalidArgument):
        extract_code(None)  # type: ignore[arg-type]


_line = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="`~\r\n"), max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    prose_before=st.lists(_line, max_size=4),
    prose_after=st.lists(_line, max_size=4),
    # Code lines start with a visible character: extract_code dedents a block's common indentation.
    body=st.lists(_line.filter(lambda s: s.strip() != "" and not s[:1].isspace()), min_size=1, max_size=6),
    fence=st.sampled_from(["```", "````", "~~~"]),
    tag=st.sampled_from(["python", "py", ""]),
)
def test_extract_code_round_trips_a_block_in_prose(prose_before, prose_after, body, fence, tag):
    code = "\n".join(body) + "\n"
    text = "\n".join(prose_before) + f"\n{fence}{tag}\n{code}{fence}\n" + "\n".join(prose_after)
    assert extract_code(text) == code


# --- grading on the embedded engine -------------------------------------------------------------


@pytest.mark.kvm
@needs_kvm
def test_the_quickstart_snippet(client):
    model_completion = "Here is my solution:\n```python\ndef solve(xs):\n    return sorted(xs)\n```"
    spec = UnitTestReward(
        template="python",
        tests="assert solve([3,1,2]) == [1,2,3]\n",
    )
    code = extract_code(model_completion)     # pull code out of an LLM completion
    result = grade(code, spec, client=client) # runs in an isolated VM
    print(result.reward)                       # 1.0 / 0.0
    assert result.reward == 1.0 and result.reason == "passed"
    assert result.seed_ack == "verified"


WRONG = "def solve(xs):\n    return xs\n"
CHEATS = {
    "wrong": WRONG,
    "syntax error": "def solve(xs) return xs",
    "crash": "raise RuntimeError('no')",
    "exit 0 early": "import sys\nsys.exit(0)\ndef solve(xs): return sorted(xs)",
    "os._exit(0)": "import os\nos._exit(0)",
    "atexit os._exit(0)": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef solve(xs): return xs",
    "sys.exit(0) inside the tests": "def solve(xs):\n    raise SystemExit(0)\n",
    "os._exit(0) inside the tests": "import os\ndef solve(xs):\n    os._exit(0)\n",
    "always-equal object": "class E:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\ndef solve(xs): return E()",
    "list subclass": "class L(list):\n    def __eq__(self, o): return True\ndef solve(xs): return L()",
    "int subclass": "class I(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\ndef solve(xs): return [I(1), I(2), I(3)]",
    "patched AssertionError": "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\ndef solve(xs): return xs",
    "fake verdict": "print('__collimate_verdict_0000:[true, true, true]')\ndef solve(xs): return xs",
    # Monkeypatching the harness and what it relies on.
    "redefined assert helper": "__collimate_strict_eq = lambda a, b: True\nimport builtins\nbuiltins.__collimate_strict_eq = lambda a, b: True\n" + WRONG,
    "patched builtins.all": "import builtins\nbuiltins.all = lambda it: True\n" + WRONG,
    "patched builtins during the call": "def solve(xs):\n    import builtins\n    builtins.all = lambda it: True\n    builtins.len = lambda x: 0\n    return xs\n",
    "shadowed exec and compile": "def exec(*a, **k): pass\ndef compile(*a, **k): return None\n" + WRONG,
    "patched os.write": "import os\n_w = os.write\nos.write = lambda fd, b: _w(fd, b.replace(b'false', b'true'))\n" + WRONG,
    "patched json.dumps": "import json\njson.dumps = lambda *a, **k: '[true, true, true]'\n" + WRONG,
    "replaced the grader": "__collimate_grader = lambda *a, **k: print('[true, true, true]')\n" + WRONG,
    "audit hook reading the tests": (
        "import sys, os, re\n"
        "def hook(event, args):\n"
        "    if event in ('compile', 'exec') and args and isinstance(args[0], str):\n"
        "        for t in re.findall(r'__collimate_verdict_[0-9a-f]+:', args[0]):\n"
        "            os.write(1, ('\\n' + t + '[true, true, true]\\n').encode())\n"
        "            os._exit(0)\n"
        "sys.addaudithook(hook)\n" + WRONG
    ),
    "trace hook": "import sys\ndef t(frame, event, arg):\n    return t\nsys.settrace(t)\nsys.setprofile(lambda *a: None)\n" + WRONG,
    "overwrite the test file": "import os\nfor d in ('/work', '/tmp'):\n    open(os.path.join(d, 'test_solution.py'), 'w').write('assert True\\n')\n" + WRONG,
    "a forked copy reports too": "import os\ndef solve(xs):\n    if os.fork() == 0:\n        return sorted(xs)\n    return xs\n",
    "loop forever": "while True:\n    pass",
    "flood output": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
}


@pytest.mark.kvm
@needs_kvm
def test_cheats_and_failures_never_score(client):
    spec = UnitTestReward(tests=SORT_TESTS, timeout_seconds=3)
    results = grade_batch(list(CHEATS.values()) + [GOOD], spec, client=client)
    for (name, _), r in zip(CHEATS.items(), results):
        assert r.reward == 0.0, (name, r.reason, r.stdout[-200:], r.stderr[-300:])
    assert results[-1].reward == 1.0, (results[-1].reason, results[-1].stderr)
    assert results[0].passed == [False, True, False]
    # The harness really ran and caught the wrong answer (not "no verdict"):
    by_name = dict(zip(CHEATS, results))
    for name in ("patched builtins.all", "patched os.write", "audit hook reading the tests", "shadowed exec and compile",
                 "redefined assert helper", "patched builtins during the call", "a forked copy reports too"):
        assert by_name[name].reason.endswith("failed"), (name, by_name[name].reason)


@pytest.mark.kvm
@needs_kvm
def test_patching_a_module_the_tests_use_does_not_pass(client):
    tests = "import math\nassert math.isclose(area(2.0), 12.566370614359172)\nassert math.fabs(area(1.0) - 3.141592653589793) < 1e-9\n"
    spec = UnitTestReward(tests=tests, timeout_seconds=5)
    good = "import math\ndef area(r):\n    return math.pi * r * r\n"
    patched = "import math\nmath.isclose = lambda *a, **k: True\nmath.fabs = lambda x: 0.0\ndef area(r):\n    return 0.0\n"
    in_call = "def area(r):\n    import math, sys\n    math.isclose = lambda *a, **k: True\n    sys.modules['math'] = type(sys)('math')\n    return 0.0\n"
    rs = grade_batch([good, patched, in_call], spec, client=client)
    assert [r.reward for r in rs] == [1.0, 0.0, 0.0], [(r.reason, r.stderr[-300:]) for r in rs]


# Candidates that try to take the host down with them. Each must score 0.0 within its time budget
# (plus the grading's own few seconds), and leave no process behind.
HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    os.fork()\n" + WRONG,
    "fork bomb inside the tests": "import os\ndef solve(xs):\n    while True:\n        os.fork()\n",
    "subprocess loop": (
        "import subprocess\nprocs = []\nwhile True:\n"
        "    procs.append(subprocess.Popen(['/bin/sh', '-c', 'while :; do :; done']))\n" + WRONG
    ),
    "1 GiB of output": "import os\nchunk = b'x' * (1 << 20)\nfor _ in range(1024):\n    os.write(1, chunk)\n" + WRONG,
    "1 GiB of output inside the tests": (
        "import sys\ndef solve(xs):\n    chunk = 'x' * (1 << 20)\n    for _ in range(1024):\n"
        "        sys.stdout.write(chunk)\n    return sorted(xs)\n"
    ),
}


def _processes_marked(mark: str) -> dict[int, int]:
    """pid -> parent pid of the host processes whose environment carries `mark`."""
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
def test_fork_bombs_and_output_floods_score_zero_quickly_and_leave_nothing(monkeypatch):
    from collimate_core import EmbeddedClient

    mark = f"collimate-hostile-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("COLLIMATE_TEST_MARK", mark)  # inherited by every VMM process this client starts
    c = EmbeddedClient()
    try:
        timeout = 5.0
        spec = UnitTestReward(tests=SORT_TESTS, timeout_seconds=timeout)
        assert grade(GOOD, spec, client=c).reward == 1.0  # the template and its zygote are up
        t = time.monotonic()
        results = grade_batch(list(HOSTILE.values()) + [GOOD], spec, client=c)
        wall = time.monotonic() - t
        for (name, _), r in zip(HOSTILE.items(), results):
            print(f"{name:34} {r.reward} {r.reason!r} in {r.duration:.2f} s, {len(r.stdout)} bytes of stdout")
            assert r.reward == 0.0, (name, r.reason, r.stderr[-300:])
            assert r.duration < 2 * timeout + 5, (name, r.duration)
            assert len(r.stdout) <= 2 * (16 << 20) + 4096, (name, len(r.stdout))  # capped per stream and exec
        assert results[-1].reward == 1.0, (results[-1].reason, results[-1].stderr[-300:])
        print(f"{len(results)} candidates graded in {wall:.1f} s")
        assert wall < 60, wall
        # Nothing left behind: once the sandboxes are reset, only the client's zygotes (children of
        # this process) and their clones (spares, recycled sandboxes) remain; no guest process.
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
    deadline = time.monotonic() + 10
    while _processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_marked(mark), "processes left after the client closed"


@pytest.mark.kvm
@needs_kvm
def test_partial_credit_and_positional_results(client):
    spec = UnitTestReward(tests=SORT_TESTS, partial_credit=True)
    half = "def solve(xs):\n    return [] if not xs else xs\n"
    rs = grade_batch([GOOD, half, "pass"], spec, client=client)
    assert [round(r.reward, 3) for r in rs] == [1.0, round(1 / 3, 3), 0.0]


@pytest.mark.kvm
@needs_kvm
def test_property_reward_uses_common_random_inputs(client):
    spec = PropertyReward(
        function="solve",
        reference="def reference(xs):\n    return sorted(xs)\n",
        generator="def gen(rng):\n    return [rng.randint(-5, 5) for _ in range(rng.randint(0, 6))]\n",
        trials=50,
    )
    buggy = "def solve(xs):\n    return sorted(set(xs))\n"  # wrong only when there are duplicates
    rs = grade_batch([GOOD, buggy, GOOD], spec, client=client)
    assert [r.reward for r in rs] == [1.0, 0.0, 1.0]
    assert len({r.seed for r in rs}) == 1  # one seed for the whole group, recorded for replay
    again = grade(buggy, spec, client=client, seed=rs[1].seed)
    assert again.passed == rs[1].passed  # the same seed replays the same inputs


@pytest.mark.kvm
@needs_kvm
def test_trl_adapter(client):
    reward = trl_reward_func(UnitTestReward(tests=SORT_TESTS), client=client)
    completions = [
        f"```python\n{GOOD}```",
        [{"role": "assistant", "content": "```python\ndef solve(xs): return xs\n```"}],
        "no code at all",
    ]
    assert reward(completions=completions, prompts=["p"] * 3) == [1.0, 0.0, 0.0]


@pytest.mark.kvm
@needs_kvm
def test_bad_specs_fail_before_anything_runs(client):
    with pytest.raises(InvalidArgument, match="parse"):
        grade(GOOD, UnitTestReward(tests="assert ("), client=client)
    with pytest.raises(InvalidArgument, match="empty"):
        grade(GOOD, UnitTestReward(tests=""), client=client)


# --- the strict equality, one spec per candidate, the fork path ---------------------------------


def test_strict_equality():
    from collimate_core.grading.harness import strict_eq

    class AlwaysEqualInt(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    assert strict_eq([1, 2.0, (3, "x")], [1.0, 2, (3, "x")])  # int and float mix, as in Python
    assert strict_eq({"a": [1]}, {"a": [1]}) and not strict_eq({"a": [1]}, {"a": [2]})
    assert not strict_eq(True, 1) and not strict_eq(1, True)  # bool is not an int here
    assert not strict_eq((1, 2), [1, 2]) and not strict_eq("1", 1)
    assert not strict_eq(AlwaysEqualInt(5), 3) and strict_eq(AlwaysEqualInt(3), 3)  # its value, not its __eq__
    assert not strict_eq([AlwaysEqualInt(5)], [3])
    assert strict_eq(float("inf"), float("inf")) and not strict_eq(float("nan"), float("nan"))



def test_tests_rewrite_every_equality_assert_at_any_depth_and_nothing_else():
    """The tests as sent: one string per top-level statement, each `assert a == b` (nested in a
    function or a class too) a call of the strict equality, other asserts and compares as they
    were; and the modules the tests import, found from the same parse."""
    from collimate_core.grading.grade import _rewritten, _split_tests

    src = (
        "import math\nfrom os.path import join\n"
        "def check(f):\n    assert f(1) == [1], 'one'\n    assert f(2) != 3\n    assert not f(3) == 4\n"
        "    assert f(0) == 0 == 0\n    assert (f(5)) == (5)\n    if True:\n        assert [i for i in range(2)] == [0, 1]\n"
        "class T:\n    def m(self):\n        assert self == 1\n"
        "x = 1; assert x == 1\n"
        "check(lambda n: n)\n"
    )
    assert _split_tests(src, "EQ") == [
        "import math",
        "from os.path import join",
        "def check(f):\n    assert EQ((f(1)), ([1])), 'one'\n    assert f(2) != 3\n    assert not f(3) == 4\n"
        "    assert f(0) == 0 == 0\n    assert EQ((f(5)), (5))\n    if True:\n        assert EQ(([i for i in range(2)]), ([0, 1]))",
        "class T:\n    def m(self):\n        assert EQ((self), (1))",
        "x = 1",
        "assert EQ((x), (1))",
        "check(lambda n: n)",
    ]
    # Spliced from the source, not unparsed: decorators, comments, non-ASCII text and line
    # continuations stay as written, and each statement parses to the tree of the rewrite.
    tricky = "@dec\n@dec2(1)\ndef g():\n    assert x == 'é€'  # c\n    assert [\n 1, # one\n 2] == \\\n  y\n"
    assert _split_tests(tricky, "EQ") == [
        "@dec\n@dec2(1)\ndef g():\n    assert EQ((x), ('é€'))  # c\n    assert EQ(([\n 1, # one\n 2]), (y))"]
    eq_name, tests, modules = _rewritten(src)
    assert modules == ("math", "os", "os.path")
    assert tests[2].startswith("def check(f):\n    assert " + eq_name + "((f(1)), ([1]))")

@pytest.mark.kvm
@needs_kvm
def test_one_spec_per_candidate(client):
    double = UnitTestReward(tests="assert f(3) == 6\nassert f(0) == 0\n")
    square = UnitTestReward(tests="import math\nassert f(3) == 9\nassert math.isqrt(f(4)) == 4\n")
    codes = ["def f(x): return 2 * x", "def f(x): return x * x", "def f(x): return x * x", "def f(x): return 2 * x"]
    rs = grade_batch(codes, [double, double, square, square], client=client)
    assert [r.reward for r in rs] == [1.0, 0.0, 1.0, 0.0], [r.reason for r in rs]
    with pytest.raises(InvalidArgument, match="one per candidate"):
        grade_batch(codes, [double, square], client=client)
    with pytest.raises(InvalidArgument, match="share their template and setup"):
        grade_batch(codes[:2], [double, UnitTestReward(tests="assert f(1) == 2\n", setup="x = 1")], client=client)


@pytest.mark.kvm
@needs_kvm
def test_setup_runs_before_the_candidate(client):
    spec = UnitTestReward(setup="DATA = [3, 1, 2]\n", tests="assert solve(DATA) == [1, 2, 3]\n")
    assert [r.reward for r in grade_batch([GOOD, WRONG], spec, client=client)] == [1.0, 0.0]
    assert grade(GOOD, spec, client=client).reward == 1.0
    with pytest.raises(InvalidArgument, match="setup failed"):
        grade(GOOD, UnitTestReward(setup="raise SystemExit(3)", tests=SORT_TESTS), client=client)


class _NoTemplates:
    """A client that cannot host templates (as a remote client): grading forks prepared parents."""

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
    spec = UnitTestReward(tests=SORT_TESTS, timeout_seconds=3)
    names = ["wrong", "atexit os._exit(0)", "patched builtins.all", "patched os.write", "a forked copy reports too"]
    rs = grade_batch([GOOD] + [CHEATS[n] for n in names] + [GOOD], spec, client=forking)
    assert [r.reward for r in rs] == [1.0] + [0.0] * len(names) + [1.0], [(r.reason, r.stderr[-200:]) for r in rs]
    assert grade(GOOD, spec, client=forking).reward == 1.0


@pytest.mark.kvm
@needs_kvm
def test_tests_can_import_a_module_the_candidate_writes(client):
    # The grader imports what the tests import before the candidate runs; `solution` is not there
    # yet, and must still be found once the candidate has written it.
    tests = "import sys\nsys.path.insert(0, '/work')\nfrom solution import solve\nassert solve([2, 1]) == [1, 2]\n"
    writes = "open('/work/solution.py', 'w').write({!r})\n"
    rs = grade_batch([writes.format(GOOD), writes.format(WRONG), "pass"], UnitTestReward(tests=tests), client=client)
    assert [r.reward for r in rs] == [1.0, 0.0, 0.0], [(r.reason, r.stderr[-300:]) for r in rs]


@pytest.mark.kvm
@needs_kvm
def test_a_grade_is_one_exec_that_scores_as_two(client):
    """A clone of a prepared template grades its candidate in one exec (the candidate's top level,
    then the tests), with the rewards of the two-exec grade (the candidate's exec, then the tests'):
    every cheat and failure 0.0 with the same reason, except where the second exec itself was the
    weak point (a patched json.dumps broke the agent's reply; a rebound `__collimate_grader` was
    called), which the one exec scores as the wrong answer they carry."""
    from collimate_core.grading import grade as grading

    spec = UnitTestReward(tests=SORT_TESTS, timeout_seconds=3)
    codes = [GOOD] + list(CHEATS.values())
    assert grade(GOOD, spec, client=client).reward == 1.0  # the prepared template is made
    before = client.usage().execs
    one = grade_batch(codes, spec, client=client, seed="ab" * 32)
    # One exec a candidate (the syntax error needs none; the output flood's is one too).
    assert client.usage().execs - before == len(codes) - 1
    grading.ONE_EXEC = False
    try:
        two = grade_batch(codes, spec, client=client, seed="ab" * 32)
    finally:
        grading.ONE_EXEC = True
    assert [r.reward for r in one] == [r.reward for r in two] == [1.0] + [0.0] * len(CHEATS)
    weak_second_exec = {"patched json.dumps", "replaced the grader"}
    for name, a, b in zip(["good"] + list(CHEATS), one, two):
        if name in weak_second_exec:
            assert a.reason.endswith("failed"), (name, a.reason)
        else:
            assert (a.reason, a.passed) == (b.reason, b.passed), name
    assert one[0].seed_ack == "verified"


@pytest.mark.kvm
@needs_kvm
def test_a_verdict_cut_off_by_the_output_cap_is_graded_again_in_two_execs(client):
    # The candidate prints more than the engine keeps of an exec's output (OUTPUT_CAP, 16 MiB):
    # the one exec's verdict is cut off, and the candidate is graded again as two execs would.
    flood = "import sys\nsys.stdout.write('x' * (17 << 20))\n"
    spec = UnitTestReward(tests=SORT_TESTS, timeout_seconds=30)
    rs = grade_batch([flood + GOOD, flood + WRONG], spec, client=client)
    assert [r.reward for r in rs] == [1.0, 0.0], [(r.reason, r.stderr[-300:]) for r in rs]
    assert rs[1].reason == "2 of 3 failed"
