"""Reward grading: a completion, or a whole GRPO group, to rewards in one call.

How a candidate is graded (UnitTestReward), in a fresh clone of the template:
1. The candidate's code runs in the sandbox's interpreter (exec 1).
2. The tests are sent only afterwards (exec 2), so the candidate never sees them, cannot overwrite
   a test file, and cannot read the per-grade verdict token they carry. Each top-level statement
   of `tests` is one test; `assert a == b` is rewritten to a strict comparison (same type for
   builtin values, no custom `__eq__` that always says yes).
3. The harness reports a verdict line tagged with that token; no verdict (an early exit, an atexit
   hook calling os._exit(0), a crash, output flooding that pushes it out, a timeout) is 0.0.

Honest failures: a candidate's timeout, crash, syntax error or wrong answer is a reward of 0.0
with the reason; an infrastructure failure (a sandbox died, the engine failed) raises and is
never scored. Known limit: code under test runs in the harness's process, so a candidate built
to inspect the harness's stack frames at test time could find the token; grading assumes
completions, not adversaries with knowledge of this harness.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from collimate_core._errors import InvalidArgument
from collimate_core._seeds import fresh_seed, group_seeds, parse_seed

__all__ = [
    "GradeResult",
    "PropertyReward",
    "UnitTestReward",
    "extract_code",
    "grade",
    "grade_batch",
    "trl_reward_func",
]

_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+#.-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)?(?P=fence)[ \t]*$",
    re.M | re.S,
)
_CODE_TAG = re.compile(r"<code(?:\s[^>]*)?>(?P<body>.*?)</code>", re.S | re.I)
_PY_TAGS = {"python", "py", "python3", "py3"}


def extract_code(completion: str, language: str = "python") -> str:
    """The code in an LLM completion.

    Fenced blocks (``` or ~~~, any indentation, with or without a language tag) win: the LAST block
    tagged `language` (python: python/py/python3), else the last untagged block. Then `<code>`
    tags (the last one). A completion with neither is returned whole if it parses as Python, else
    "" (nothing to grade; the grade is 0.0). Raises InvalidArgument for a non-str completion.
    """
    if not isinstance(completion, str):
        raise InvalidArgument(f"extract_code takes the completion text (str), not {type(completion).__name__}")
    want = _PY_TAGS if language.lower() in _PY_TAGS else {language.lower()}
    tagged, untagged = [], []
    for m in _FENCE.finditer(completion):
        body = textwrap.dedent(m.group("body"))
        lang = m.group("lang").lower()
        if lang in want:
            tagged.append(body)
        elif not lang:
            untagged.append(body)
    if tagged or untagged:
        return (tagged or untagged)[-1].strip("\n") + "\n"
    tags = _CODE_TAG.findall(completion)
    if tags:
        return textwrap.dedent(tags[-1]).strip("\n") + "\n"
    text = completion.strip("\n")
    if text.strip() and language.lower() in _PY_TAGS:
        try:
            ast.parse(text)
            return text + "\n"
        except SyntaxError:
            return ""
    return ""


@dataclass(frozen=True)
class GradeResult:
    """The reward of one candidate, with why."""

    reward: float
    reason: str
    passed: list[bool] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    seed: str = ""
    seed_ack: str = ""
    duration: float = 0.0


_STRICT = '''
def __collimate_strict_eq(a, b):
    plain = (int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset)
    if isinstance(a, plain) or isinstance(b, plain):
        if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                           and type(a) is not bool and type(b) is not bool):
            return False
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(__collimate_strict_eq(x, y) for x, y in zip(a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(__collimate_strict_eq(a[k], b[k]) for k in a)
    return bool(a == b) is True and bool(b == a) is True
'''


class _StrictAsserts(ast.NodeTransformer):
    """`assert x == y` -> `assert __collimate_strict_eq(x, y)`."""

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            call = ast.Call(func=ast.Name("__collimate_strict_eq", ast.Load()), args=[t.left, t.comparators[0]], keywords=[])
            node.test = ast.copy_location(call, t)
        return node


def _split_tests(tests: str) -> list[str]:
    try:
        tree = ast.parse(tests)
    except SyntaxError as e:
        raise InvalidArgument(f"the tests do not parse as Python: {e}") from None
    out = []
    for stmt in tree.body:
        stmt = _StrictAsserts().visit(stmt)
        ast.fix_missing_locations(stmt)
        out.append(ast.unparse(stmt))
    if not out:
        raise InvalidArgument("tests is empty: give at least one assert statement")
    return out


def _harness(token: str, tests: list[str]) -> str:
    return (
        _STRICT
        + f"""
import os as __os, json as __json, traceback as __tb
__collimate_results = []
for __src in {tests!r}:
    try:
        exec(compile(__src, "<test>", "exec"), globals())
        __collimate_results.append(True)
    except BaseException:
        __collimate_results.append(False)
__os.write(1, ("\\n{token}" + __json.dumps(__collimate_results) + "\\n").encode())
"""
    )


@dataclass(frozen=True)
class UnitTestReward:
    """Run the candidate, then `tests` (assert statements) against it, in an isolated clone.

    reward = 1.0 when every test passes, else 0.0; with partial_credit, the fraction passed.
    """

    template: str = "python"
    tests: str = ""
    timeout_seconds: float = 30.0
    partial_credit: bool = False
    setup: str | None = None

    def _parts(self) -> list[str]:
        return _split_tests(self.tests)


@dataclass(frozen=True)
class PropertyReward:
    """Check `function` of the candidate against `reference` on generated inputs.

    `generator` is source defining `gen(rng)` (rng: random.Random) that returns one input (a tuple
    is splatted as arguments); `reference` is source defining `reference(...)`. Inputs come from the
    grade's seed, so every candidate of a group (grade_batch) sees the same inputs (common random
    numbers), and the seed is recorded for replay.
    """

    template: str = "python"
    function: str = "solve"
    reference: str = ""
    generator: str = ""
    trials: int = 100
    timeout_seconds: float = 30.0
    seed: str | None = None

    def _parts(self) -> list[str]:
        for name, src in (("reference", self.reference), ("generator", self.generator)):
            try:
                ast.parse(src)
            except SyntaxError as e:
                raise InvalidArgument(f"PropertyReward.{name} does not parse: {e}") from None
        if not self.function.isidentifier():
            raise InvalidArgument(f"PropertyReward.function must be a name, not {self.function!r}")
        return [f"__collimate_property_{k}" for k in range(self.trials)]


def _property_harness(spec: PropertyReward, token: str, seed: str) -> str:
    return (
        _STRICT
        + spec.reference
        + "\n"
        + spec.generator
        + f"""
import os as __os, json as __json, random as __random, copy as __copy
__rng = __random.Random(int("{seed}", 16))
__collimate_results = []
for __k in range({spec.trials}):
    __x = gen(__rng)
    __args = __x if isinstance(__x, tuple) else (__x,)
    try:
        __want = reference(*__copy.deepcopy(__args))
        __got = {spec.function}(*__copy.deepcopy(__args))
        __collimate_results.append(bool(__collimate_strict_eq(__got, __want)))
    except BaseException:
        __collimate_results.append(False)
__os.write(1, ("\\n{token}" + __json.dumps(__collimate_results) + "\\n").encode())
"""
    )


def _verdict(stdout: str, token: str) -> list[bool] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(token):
            try:
                v = json.loads(line[len(token) :])
            except ValueError:
                return None
            return v if isinstance(v, list) and all(isinstance(x, bool) for x in v) else None
    return None


def _grade_in(sandbox, code: str, spec, seed: str | None) -> GradeResult:
    """Grade `code` in a live sandbox (consumed: its state is the candidate's afterwards)."""
    if not isinstance(code, str):
        raise InvalidArgument(f"the candidate code must be a str, not {type(code).__name__}")
    token = "__collimate_verdict_" + secrets.token_hex(16) + ":"
    timeout = spec.timeout_seconds
    if not code.strip():
        return GradeResult(0.0, "no code to grade")
    try:
        compile(code, "<candidate>", "exec")
    except SyntaxError as e:
        return GradeResult(0.0, f"syntax error: {e}")
    r1 = sandbox.exec(code=code, timeout_seconds=timeout, seed=seed)
    if r1.timed_out:
        return GradeResult(0.0, "timeout", stdout=r1.stdout, stderr=r1.stderr, seed=r1.seed, seed_ack=r1.seed_ack, duration=r1.duration)
    if r1.exit_code != 0:
        return GradeResult(0.0, f"the candidate failed (exit code {r1.exit_code})", stdout=r1.stdout, stderr=r1.stderr,
                           seed=r1.seed, seed_ack=r1.seed_ack, duration=r1.duration)
    if isinstance(spec, PropertyReward):
        harness = _property_harness(spec, token, r1.seed)
        n = spec.trials
    else:
        parts = spec._parts()
        harness = _harness(token, parts)
        n = len(parts)
    r2 = sandbox.exec(code=harness, timeout_seconds=timeout, seed=r1.seed)
    out, err = r1.stdout + r2.stdout, r1.stderr + r2.stderr
    dur = r1.duration + r2.duration
    if r2.timed_out:
        return GradeResult(0.0, "timeout in the tests", stdout=out, stderr=err, seed=r1.seed, seed_ack=r1.seed_ack, duration=dur)
    verdict = _verdict(r2.stdout, token)
    if verdict is None or len(verdict) != n:
        return GradeResult(0.0, "no verdict (the program ended or hid the harness's report)", stdout=out, stderr=err,
                           seed=r1.seed, seed_ack=r1.seed_ack, duration=dur)
    passed = sum(verdict)
    partial = getattr(spec, "partial_credit", False)
    reward = passed / n if partial else (1.0 if passed == n else 0.0)
    reason = "passed" if passed == n else f"{n - passed} of {n} failed"
    return GradeResult(reward, reason, verdict, out, err, r1.seed, r1.seed_ack, dur)


def grade(code: str, spec: UnitTestReward | PropertyReward, *, client: Any = None, seed: str | None = None) -> GradeResult:
    """Grade one candidate in an isolated clone of spec.template."""
    from collimate_core._session import Sandbox

    spec._parts()  # bad specs fail before anything runs
    if seed is None and isinstance(spec, PropertyReward) and spec.seed:
        seed = spec.seed
    if seed is not None:
        seed = parse_seed(seed).hex()
    with Sandbox(spec.template, client=client) as sb:
        if getattr(spec, "setup", None):
            r = sb.exec(code=spec.setup, timeout_seconds=spec.timeout_seconds)
            if not r.ok:
                raise InvalidArgument(f"the spec's setup failed (exit {r.exit_code}): {r.stderr[-500:]}")
        return _grade_in(sb, code, spec, seed)


def grade_batch(
    codes: Sequence[str], spec: UnitTestReward | PropertyReward, *, client: Any = None, seed: str | None = None
) -> list[GradeResult]:
    """Grade a GRPO group: the template's clone and the spec's setup are paid once, then the
    candidates run in forked children in parallel. Results are positional. Every candidate of the
    group runs with the same seed (common random numbers), recorded in each result."""
    from collimate_core._session import Sandbox

    codes = list(codes)
    if not codes:
        return []
    spec._parts()
    base = parse_seed(seed).hex() if seed is not None else (spec.seed if isinstance(spec, PropertyReward) and spec.seed else fresh_seed())
    with Sandbox(spec.template, client=client) as parent:
        if getattr(spec, "setup", None):
            r = parent.exec(code=spec.setup, timeout_seconds=spec.timeout_seconds)
            if not r.ok:
                raise InvalidArgument(f"the spec's setup failed (exit {r.exit_code}): {r.stderr[-500:]}")
        with parent.fork_group(len(codes), seed=base) as grp:
            return grp.map(lambda i, child: _grade_in(child, codes[i], spec, base))


def trl_reward_func(spec: UnitTestReward | PropertyReward, *, client: Any = None, language: str = "python") -> Callable[..., list[float]]:
    """A reward function for TRL's GRPOTrainer(reward_funcs=[...]): takes `completions` (strings,
    or conversations whose last message holds the answer) and returns one float per completion."""

    def reward(completions: Sequence[Any], **_: Any) -> list[float]:
        texts = []
        for c in completions:
            if isinstance(c, list) and c and isinstance(c[-1], dict):
                c = c[-1].get("content", "")
            texts.append(extract_code(str(c), language))
        return [g.reward for g in grade_batch(texts, spec, client=client)]

    reward.__name__ = f"collimate_{type(spec).__name__}"
    return reward
