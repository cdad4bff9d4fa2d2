"""Reward grading: extract_code, UnitTestReward, PropertyReward, grade, grade_batch, the TRL adapter,
and candidates that try to score without solving."""

from __future__ import annotations

import os

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


CHEATS = {
    "wrong": "def solve(xs):\n    return xs\n",
    "syntax error": "def solve(xs) return xs",
    "crash": "raise RuntimeError('no')",
    "exit 0 early": "import sys\nsys.exit(0)\ndef solve(xs): return sorted(xs)",
    "os._exit(0)": "import os\nos._exit(0)",
    "atexit os._exit(0)": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef solve(xs): return xs",
    "always-equal object": "class E:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\ndef solve(xs): return E()",
    "list subclass": "class L(list):\n    def __eq__(self, o): return True\ndef solve(xs): return L()",
    "patched AssertionError": "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\ndef solve(xs): return xs",
    "fake verdict": "print('__collimate_verdict_0000:[true, true, true]')\ndef solve(xs): return xs",
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
