"""Trainer integrations on a mixed batch: 8 prompts x 8 completions, each prompt with its own tests.

The call shapes are the frameworks' documented ones (neither package is installed here: TRL needs
torch, veRL needs torch and ray):
- TRL, GRPOTrainer's custom reward functions (TRL docs, "Using a custom reward function"): called
  with keyword arguments `prompts`, `completions` (strings, or conversations: lists of
  {"role", "content"} messages), `completion_ids`, `trainer_state` and every other dataset column
  as a list aligned with the completions (each prompt's row repeated num_generations times);
  returns one float (or None) per completion; coroutine functions are awaited.
- veRL, custom reward function (veRL docs, "Implement Reward Function for Dataset" /
  custom_reward_function): `compute_score(data_source, solution_str, ground_truth, extra_info=None,
  **kwargs)`, called with keywords by the reward manager; ground truth for code as sandbox fusion
  stores it, {"inputs": [...], "outputs": [...]} or its JSON string, or test code.
Each adapter's rewards must equal grading each row on its own (grade_batch of the row's
completions against the row's spec), and what the completions were built to score.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from collimate_rl import GroupError, InvalidArgument, IOTestReward, UnitTestReward, connect, extract_code, grade_batch
from collimate_rl.integrations import completion_text, score_rows, spec_from_tests
from collimate_rl.integrations import trl as trl_adapter
from collimate_rl.integrations import verl as verl_adapter

needs_kvm = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

# name: (cases, a right program, a wrong program)
PROBLEMS = {
    "add": ([("1 2\n", "3\n"), ("10 -4\n", "6\n"), ("0 0\n", "0\n")],
            "a, b = map(int, input().split())\nprint(a + b)", "a, b = map(int, input().split())\nprint(a * b)"),
    "reverse": ([("abc\n", "cba\n"), ("x\n", "x\n"), ("hello world\n", "dlrow olleh\n")],
                "print(input()[::-1])", "print(input())"),
    "vowels": ([("banana\n", "3\n"), ("xyz\n", "0\n"), ("AEIOU\n", "5\n")],
               "print(sum(c in 'aeiouAEIOU' for c in input()))", "print(sum(c in 'aeiou' for c in input()))"),
    "max": ([("3\n1 5 2\n", "5\n"), ("1\n-7\n", "-7\n"), ("4\n2 2 9 9\n", "9\n")],
            "input()\nprint(max(map(int, input().split())))", "input()\nprint(min(map(int, input().split())))"),
    "fizzbuzz": ([("5\n", "1\n2\nFizz\n4\nBuzz\n"), ("3\n", "1\n2\nFizz\n"), ("1\n", "1\n")],
                 "n = int(input())\nfor i in range(1, n + 1):\n    print('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0) or i)",
                 "n = int(input())\nfor i in range(1, n):\n    print(i)"),
    "factorial": ([("5\n", "120\n"), ("0\n", "1\n"), ("10\n", "3628800\n")],
                  "import math\nprint(math.factorial(int(input())))", "n = int(input())\nprint(n * (n - 1))"),
    "palindrome": ([("abba\n", "YES\n"), ("abc\n", "NO\n"), ("a\n", "YES\n")],
                   "s = input()\nprint('YES' if s == s[::-1] else 'NO')", "print('YES')"),
    "sort": ([("3 1 2\n", "1 2 3\n"), ("5\n", "5\n"), ("2 -1 2\n", "-1 2 2\n")],
             "print(*sorted(map(int, input().split())))", "print(*map(int, input().split()))"),
}


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}\n```\n"


def completions_for(k: int, right: str, wrong: str) -> list[tuple[object, float]]:
    """8 completions of one prompt and the reward each must get."""
    eighth = ("while True:\n    pass", 0.0) if k < 2 else (f"print({k})", 0.0)
    return [
        (fenced(right), 1.0),
        ([{"role": "assistant", "content": fenced(right)}], 1.0),  # conversational
        (fenced(right, tag=""), 1.0),  # an untagged fence
        (fenced(wrong), 0.0),
        (fenced("raise RuntimeError('no')"), 0.0),
        ("I cannot solve this.", 0.0),  # no code: 0.0
        (fenced(right + "\nimport sys\nsys.stdout.write('   \\r\\n')"), 1.0),  # trailing whitespace, CRLF
        (fenced(eighth[0]), eighth[1]),
    ]


def batch():
    """The GRPO step: rows (TRL's columns, repeated per completion) and completions."""
    prompts, completions, columns, want = [], [], {"tests": [], "task_id": [], "unit_tests": []}, []
    for k, (name, (cases, right, wrong)) in enumerate(PROBLEMS.items()):
        gt = json.dumps({"inputs": [c[0] for c in cases], "outputs": [c[1] for c in cases]})
        for completion, reward in completions_for(k, right, wrong):
            prompts.append(f"Solve {name}: read stdin, write stdout.")
            completions.append(completion)
            columns["tests"].append(gt)
            columns["task_id"].append(name)
            columns["unit_tests"].append(f"assert {name!r} == {name!r}\n")
            want.append(reward)
    return prompts, completions, columns, want


SPEC_OPTIONS = {"time_limit_seconds": 1.5}


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    return connect()


@pytest.fixture(scope="module")
def alone(client):
    """Each row graded on its own: grade_batch of its 8 completions against its spec."""
    prompts, completions, columns, want = batch()
    out = []
    for start in range(0, len(completions), 8):
        spec = IOTestReward(cases=PROBLEMS[columns["task_id"][start]][0], **SPEC_OPTIONS)
        codes = [extract_code(completion_text(c)) for c in completions[start : start + 8]]
        out += [r.reward for r in grade_batch(codes, spec, client=client)]
    assert out == want, [(i, columns["task_id"][i], o, w) for i, (o, w) in enumerate(zip(out, want)) if o != w]
    return out


def trl_call(fn, prompts, completions, columns):
    """The keywords GRPOTrainer passes a custom reward function."""
    return fn(prompts=prompts, completions=completions, completion_ids=[[1, 2, 3]] * len(completions),
              trainer_state=None, **columns)


@pytest.mark.kvm
@needs_kvm
def test_trl_reward_func_on_a_mixed_batch(client, alone):
    prompts, completions, columns, want = batch()
    fn = trl_adapter.reward_func(tests_column="tests", kind="io", client=client, **SPEC_OPTIONS)
    assert not asyncio.iscoroutinefunction(fn) and fn.__name__.startswith("collimate_")
    rewards = trl_call(fn, prompts, completions, columns)
    assert rewards == alone == want
    assert all(type(r) is float for r in rewards)


@pytest.mark.kvm
@needs_kvm
def test_trl_async_reward_func_runs_concurrently(client, alone):
    prompts, completions, columns, _ = batch()
    fn = trl_adapter.reward_func(tests_column="tests", kind="io", client=client, asynchronous=True, **SPEC_OPTIONS)
    assert asyncio.iscoroutinefunction(fn)
    half = len(completions) // 2
    cols_a = {k: v[:half] for k, v in columns.items()}
    cols_b = {k: v[half:] for k, v in columns.items()}

    async def step():
        # Two reward calls awaited together, as TRL gathers its async reward functions.
        return await asyncio.gather(trl_call(fn, prompts[:half], completions[:half], cols_a),
                                    trl_call(fn, prompts[half:], completions[half:], cols_b))

    a, b = asyncio.run(step())
    assert a + b == alone


@pytest.mark.kvm
@needs_kvm
def test_trl_unit_kind_and_bad_columns(client):
    fn = trl_adapter.reward_func(tests_column="checks", kind="unit", client=client)
    completions = [fenced("def f(x):\n    return 2 * x"), fenced("def f(x):\n    return x"),
                   [{"role": "user", "content": "write f"}, {"role": "assistant", "content": fenced("def f(x):\n    return x * x")}],
                   fenced("def f(x):\n    return x + x")]
    checks = ["assert f(3) == 6\n", "assert f(3) == 6\n", "assert f(3) == 9\nassert f(2) == 4\n",
              "assert f(3) == 9\n"]
    assert trl_call(fn, ["p"] * 4, completions, {"checks": checks}) == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(InvalidArgument, match="no column 'checks'"):
        trl_call(fn, ["p"] * 4, completions, {"tests": checks})
    with pytest.raises(InvalidArgument):
        trl_call(fn, ["p"] * 4, completions, {"checks": checks[:3]})
    io = trl_adapter.reward_func(tests_column="checks", kind="io", client=client)
    with pytest.raises(InvalidArgument, match="kind 'io'"):
        trl_call(io, ["p"] * 4, completions, {"checks": checks})


@pytest.mark.kvm
@needs_kvm
def test_verl_compute_score_gives_the_same_scores(client, alone):
    _, completions, columns, _ = batch()
    # veRL hands over the decoded response text; the conversational rows become their content.
    texts = [completion_text(c) for c in completions]
    scores = []
    for i, (text, gt) in enumerate(zip(texts, columns["tests"])):
        # The ground truth as a JSON string for even rows, as the parsed dict for odd ones.
        ground_truth = gt if i % 2 == 0 else json.loads(gt)
        scores.append(verl_adapter.compute_score(data_source="codecontests", solution_str=text,
                                                 ground_truth=ground_truth, extra_info={"index": i},
                                                 client=client, **SPEC_OPTIONS))
    assert scores == alone
    batch_scores = verl_adapter.compute_score_batch(["codecontests"] * len(texts), texts, columns["tests"],
                                                    [None] * len(texts), client=client, **SPEC_OPTIONS)
    assert batch_scores == alone

    async def some():
        rows = range(0, len(texts), 5)
        return await asyncio.gather(*[verl_adapter.compute_score_async(
            "codecontests", texts[i], columns["tests"][i], None, client=client, **SPEC_OPTIONS) for i in rows])

    assert list(asyncio.run(some())) == [alone[i] for i in range(0, len(texts), 5)]
    # Test code as ground truth, and a list of {"input", "output"} dicts.
    assert verl_adapter.compute_score("x", fenced("def f(x):\n    return x + 1"), "assert f(1) == 2\n", client=client) == 1.0
    assert verl_adapter.compute_score("x", fenced("def f(x):\n    return x"), "assert f(1) == 2\n", client=client) == 0.0
    cases = [{"input": "4\n", "output": "16\n"}, {"input": "0\n", "output": "0\n"}]
    assert verl_adapter.compute_score("x", fenced("print(int(input()) ** 2)"), cases, client=client) == 1.0
    with pytest.raises(InvalidArgument, match="call-based"):
        verl_adapter.compute_score("x", "print(1)", {"fn_name": "f", "inputs": [[1]], "outputs": [[2]]}, client=client)


@pytest.mark.kvm
@needs_kvm
def test_score_rows_and_spec_from_tests(client):
    rows = [{"tests": {"inputs": ["2\n"], "outputs": ["4\n"]}}, {"tests": "assert f(2) == 4\n"},
            {"tests": [("3\n", "9\n")]}, UnitTestReward(tests="assert f(5) == 10\n")]
    completions = [fenced("print(2 * int(input()))"), fenced("def f(x): return x * x"),
                   fenced("print(int(input()) * 3)"), fenced("def f(x): return x * 2")]
    assert score_rows(rows, completions, client=client) == [1.0, 1.0, 1.0, 1.0]
    assert score_rows(rows, completions[::-1], client=client) == [0.0, 0.0, 0.0, 0.0]
    # One spec per distinct tests value: rows that repeat a prompt share it.
    gt = {"inputs": ["1\n"], "outputs": ["1\n"]}
    assert spec_from_tests(gt, "io") is spec_from_tests(json.loads(json.dumps(gt)), "io")
    assert spec_from_tests(gt, None, partial_credit=True).partial_credit
    assert isinstance(spec_from_tests("assert True\n"), UnitTestReward)
    mbpp = spec_from_tests(["assert f(1) == 2", "assert f(2) == 4"], "unit")
    assert mbpp.tests == "assert f(1) == 2\nassert f(2) == 4\n"
    assert score_rows([{"test_list": ["assert f(1) == 2", "assert f(2) == 4"]}] * 2,
                      [fenced("def f(x): return 2 * x"), fenced("def f(x): return x + 1")], tests_key="test_list",
                      client=client) == [1.0, 0.0]
    with pytest.raises(InvalidArgument):
        spec_from_tests(gt, "io", no_such_option=1)
    with pytest.raises(InvalidArgument):
        score_rows(rows[:2], completions, client=client)


@pytest.mark.kvm
@needs_kvm
def test_infrastructure_failures_raise_or_score_none(monkeypatch):
    from collimate_core import EmbeddedClient
    from test_iotest import _processes_marked

    mark = f"collimate-integrations-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("COLLIMATE_TEST_MARK", mark)
    c = EmbeddedClient()
    try:
        prompts, completions, columns, want = batch()
        rows = slice(16, 24)  # one prompt, no time limits hit
        args = (prompts[rows], completions[rows], {k: v[rows] for k, v in columns.items()})
        fn = trl_adapter.reward_func(tests_column="tests", kind="io", client=c)
        assert trl_call(fn, *args) == want[rows]
        for pid in _processes_marked(mark):  # the client's VMM processes die (from the host)
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(GroupError):
            trl_call(fn, *args)
        masked = trl_adapter.reward_func(tests_column="tests", kind="io", client=c, on_infra_error="none")
        got = trl_call(masked, *args)
        # Rows with code to grade needed a sandbox: None; the one without code never did: 0.0.
        assert got == [0.0 if "cannot" in str(comp) else None for comp in completions[rows]], got
        assert verl_adapter.compute_score("x", completions[16], columns["tests"][16], client=c,
                                          on_infra_error="none") is None
    finally:
        c.close()


@pytest.mark.kvm
@needs_kvm
def test_over_http(tmp_path_factory):
    """The same rows through the control plane (a RemoteClient hosts no templates: each case runs in
    a fresh child of a prepared parent)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from test_http import Server, _cli

    from collimate_rl import RemoteClient

    tmp = tmp_path_factory.mktemp("http")
    store = tmp / "keys.json"
    key = _cli("keys", "--key-store", str(store), "create", "--tenant", "trainer").strip()
    srv = Server(tmp, store, "--max-sandboxes", "24")
    try:
        prompts, completions, columns, want = batch()
        rows = slice(16, 32)  # two prompts, no time limits hit
        with RemoteClient(key, srv.url) as remote:
            fn = trl_adapter.reward_func(tests_column="tests", kind="io", client=remote, **SPEC_OPTIONS)
            got = trl_call(fn, prompts[rows], completions[rows], {k: v[rows] for k, v in columns.items()})
            assert got == want[rows]
            assert verl_adapter.compute_score("x", completions[16], columns["tests"][16], client=remote) == want[16]
    finally:
        srv.stop()
