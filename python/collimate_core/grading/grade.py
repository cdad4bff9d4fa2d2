"""Reward grading: a completion, or a whole GRPO group, to rewards in one call.

How a candidate is graded (UnitTestReward), in a fresh clone of the template:
0. Before any candidate: the spec's setup runs, then the grader (harness.py) is installed
   in the sandbox's interpreter: it imports what the tests import, records the interpreter as it
   is (module attributes, builtins) and refuses audit hooks from then on. On the embedded engine
   this prepared sandbox is checkpointed once as a template (pool.py) that every later
   grade with the same template and setup clones; elsewhere grade_batch prepares one parent per
   group and forks a child of it per candidate.
1. The candidate's code runs in the sandbox's interpreter (exec 1).
2. The tests are sent only afterwards (exec 2), so the candidate never sees them, cannot overwrite
   a test file, and cannot read the per-grade verdict token they carry. Each top-level statement
   of `tests` is one test; `assert a == b` is rewritten to a strict comparison (same type for
   builtin values, no custom `__eq__` that always says yes) under a name drawn per grade. Before
   each test the grader undoes what the candidate monkeypatched (`builtins.all = ...`,
   `os.write = ...`, `math.fabs = ...`, trace hooks), and the test code gets its own copy of the
   builtins.
3. The grader reports a verdict line tagged with that token; no verdict (an early exit, an atexit
   hook calling os._exit(0), a crash, output flooding that pushes it out, a timeout) is 0.0.

Honest failures: a candidate's timeout, crash, syntax error or wrong answer is a reward of 0.0
with the reason; an infrastructure failure (a sandbox died, the engine failed) raises and is
never scored. Known limit: code under test runs in the grader's process, so a candidate written
against this harness (ctypes, or walking frames or gc objects at test time to find the token)
could forge a verdict; grading stops generic monkeypatching, not adversaries who read this code.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import itertools
import json
import os
import re
import secrets
import textwrap
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from collimate_core.grading import pool as _grading_pool
from collimate_core.sdk.errors import CollimateError, EngineError, GroupError, InvalidArgument
from collimate_core.sdk.seeds import fresh_seed, parse_seed

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


_RUNNER = "__collimate_grader"
_HARNESS_SOURCE: str | None = None
# Imported before any candidate, in every grading sandbox (besides what the tests import): modules
# that tests and solutions commonly use. A candidate's `from typing import List` is then a lookup,
# not an import in a fresh sandbox, and the grader can undo a candidate's patching of them.
_BASE_PRELOAD = ("bisect", "collections", "copy", "functools", "heapq", "itertools", "math", "operator",
                 "random", "re", "string", "typing")


@functools.lru_cache(maxsize=1024)
def _imports(*sources: str) -> tuple[str, ...]:
    """The modules `sources` import (absolute imports, with their parent packages), sorted."""
    names: set[str] = set()
    for src in sources:
        try:
            tree = ast.parse(src or "")
        except SyntaxError:
            continue
        names.update(_tree_imports(tree))
    return tuple(sorted(names))


# Where statements nest inside statements (a function's or a class's body, if/for/while/with/try
# branches, except handlers, match cases): the only places an import or an assert can be.
_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


def _statements(stmts: list) -> list:
    """Every statement of `stmts` at any depth, without visiting expressions (which hold none):
    a fraction of an ast.walk's nodes."""
    out, stack = [], list(stmts)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.stmt):
            out.append(node)
        for name in _BODIES:
            stack.extend(getattr(node, name, ()))
    return out


def _tree_imports(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module]
        else:
            continue
        for name in found:
            parts = name.split(".")
            names.update(".".join(parts[: k + 1]) for k in range(len(parts)))
    return names


def _spec_imports(spec) -> tuple[str, ...]:
    if isinstance(spec, PropertyReward):
        return _imports(spec.reference, spec.generator)
    if isinstance(spec.tests, str):
        try:
            return _rewritten(spec.tests)[2]  # parsed once, with the rewrite the tests need anyway
        except InvalidArgument:
            pass
    return _imports(spec.tests)


def _prelude(preload: Sequence[str] = ()) -> str:
    """The exec that installs the grader (harness.py) before any candidate runs: its
    source runs in a private namespace with its own copy of the builtins, and only `_RUNNER` is
    left in the sandbox's namespace. `preload`: the modules the tests import, imported now (once
    per group, and snapshotted so that the grader can undo a candidate's patching of them)."""
    global _HARNESS_SOURCE
    if _HARNESS_SOURCE is None:
        _HARNESS_SOURCE = (Path(__file__).resolve().parent / "harness.py").read_text()
    return installer(_HARNESS_SOURCE, "grader", preload, _RUNNER)


def installer(source: str, label: str, preload: Sequence[str], names: str) -> str:
    """The exec that installs an in-guest grading module: `source` runs in a private namespace with
    its own copy of the builtins, its `install(preload)` returns what is bound to `names` in the
    sandbox's namespace, and nothing else of it is left there."""
    return (
        "def __collimate_install(src):\n"
        "    import builtins\n"
        f"    g = {{'__builtins__': dict(vars(builtins)), '__name__': '__collimate_{label}__'}}\n"
        f"    exec(compile(src, '<collimate-{label}>', 'exec'), g)\n"
        f"    return g['install']({list(preload)!r})\n"
        f"{names} = __collimate_install({source!r})\n"
        "del __collimate_install\n"
    )


def verdict_without_sandbox(code: str) -> GradeResult | None:
    """The verdict of a candidate that needs no sandbox (no code, a syntax error), else None."""
    if not code.strip():
        return GradeResult(0.0, "no code to grade")
    try:
        compile(code, "<candidate>", "exec")
    except SyntaxError as e:
        return GradeResult(0.0, f"syntax error: {e}")
    return None


def _split_tests(tests: str, eq_name: str = "__collimate_eq") -> list[str]:
    return _split_tree(_parse_tests(tests), tests, eq_name)


def _parse_tests(tests: str) -> ast.Module:
    if not isinstance(tests, str):
        raise InvalidArgument(f"tests must be Python source (str), not {type(tests).__name__}")
    try:
        return ast.parse(tests)
    except SyntaxError as e:
        raise InvalidArgument(f"the tests do not parse as Python: {e}") from None


def _split_tree(tree: ast.Module, source: str, eq_name: str) -> list[str]:
    """The top-level statements of `source` (parsed as `tree`), each as its own source text, with
    every `assert a == b` at any depth made `assert <eq_name>((a), (b))` (the grader's strict
    equality). The text is spliced from the source by the nodes' positions (an assert's test holds
    no assert, so the replaced spans never overlap), not unparsed from the tree: a fraction of the
    cost, the same statements."""
    data = source.encode()
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))

    def at(line: int, col: int) -> int:  # ast columns are UTF-8 byte offsets
        return starts[line - 1] + col

    def text(node: ast.AST) -> bytes:
        return data[at(node.lineno, node.col_offset) : at(node.end_lineno, node.end_col_offset)]

    eq = eq_name.encode()
    out = []
    for stmt in tree.body:
        pos, end = at(stmt.lineno, stmt.col_offset), at(stmt.end_lineno, stmt.end_col_offset)
        decorators = getattr(stmt, "decorator_list", None)
        if decorators:  # the statement starts at its first decorator's `@`, before that expression
            pos = data.rindex(b"@", 0, at(decorators[0].lineno, decorators[0].col_offset))
        spans = []
        for node in _statements([stmt]):
            if isinstance(node, ast.Assert):
                t = node.test
                if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
                    call = eq + b"((" + text(t.left) + b"), (" + text(t.comparators[0]) + b"))"
                    spans.append((at(t.lineno, t.col_offset), at(t.end_lineno, t.end_col_offset), call))
        pieces = []
        for a, b, call in sorted(spans):
            pieces += [data[pos:a], call]
            pos = b
        pieces.append(data[pos:end])
        out.append(b"".join(pieces).decode())
    if not out:
        raise InvalidArgument("tests is empty: give at least one assert statement")
    return out


def _seal(nonce: str) -> list[str]:
    """The token's nonce as two random halves (XOR), joined by the grader only to report."""
    key = secrets.token_hex(16)
    return [key, format(int(nonce, 16) ^ int(key, 16), "032x")]


@functools.lru_cache(maxsize=1024)
def _rewritten(tests: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """The tests of a spec, ready to send: the strict equality's name (random, drawn once per
    tests text in this process; a candidate never sees it before the tests arrive), the
    rewritten top-level statements, and the modules they import. Raises InvalidArgument."""
    eq_name = "__collimate_eq_" + secrets.token_hex(8)
    tree = _parse_tests(tests)  # one parse: the imports and the rewrite
    modules = tuple(sorted(_tree_imports(tree)))
    return eq_name, tuple(_split_tree(tree, tests, eq_name)), modules


def _harness(nonce: str, spec: "UnitTestReward", candidate: tuple[str, str, str] | None = None) -> tuple[str, int]:
    eq_name, tests, modules = _rewritten(spec.tests)
    payload = {"eq": eq_name, "tests": list(tests), "modules": list(modules)}
    return f"{_RUNNER}(globals(), {_seal(nonce)!r}, 'unit', {payload!r}{_candidate_arg(candidate)})\n", len(tests)


def _candidate_arg(candidate: tuple[str, str, str] | None) -> str:
    return "" if candidate is None else f", {candidate!r}"


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
        if not isinstance(self.tests, str):
            raise InvalidArgument(f"tests must be Python source (str), not {type(self.tests).__name__}")
        return list(_rewritten(self.tests)[1])


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
        if not isinstance(self.function, str) or not self.function.isidentifier():
            raise InvalidArgument(f"PropertyReward.function must be a name, not {self.function!r}")
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise InvalidArgument(f"PropertyReward.trials must be a positive int, not {self.trials!r}")
        return [f"__collimate_property_{k}" for k in range(self.trials)]


def _property_harness(spec: PropertyReward, nonce: str, seed: str, candidate: tuple[str, str, str] | None = None) -> str:
    payload = {
        "function": spec.function,
        "reference": spec.reference,
        "generator": spec.generator,
        "trials": int(spec.trials),
        "seed": seed,
        "modules": list(_spec_imports(spec)),
    }
    return f"{_RUNNER}(globals(), {_seal(nonce)!r}, 'property', {payload!r}{_candidate_arg(candidate)})\n"


def _verdict(stdout: str, token: str) -> list[bool] | None:
    """The grader's report: exactly one line starting with the token (more than one means a copy
    of the grader in another process reported too: no verdict)."""
    lines = [line for line in stdout.splitlines() if line.startswith(token)]
    if len(lines) != 1:
        return None
    try:
        v = json.loads(lines[0][len(token) :])
    except ValueError:
        return None
    return v if isinstance(v, list) and all(isinstance(x, bool) for x in v) else None


# Whether a clone of a prepared template grades its candidate in one exec (see _grade_one_exec);
# False: two execs, the candidate's then the tests' (benches compare the two).
ONE_EXEC = True


def _grade_in(sandbox, code: str, spec, seed: str | None, *, checked: bool = False, one_exec: bool = False) -> GradeResult:
    """Grade `code` in a live sandbox where `_prepare` ran (consumed: its state is the candidate's
    afterwards). `checked`: the caller already found verdict_without_sandbox(code) to be None.
    `one_exec`: the sandbox is a clone of a prepared template (so that `reset` brings the grader
    back): grade in one exec where ONE_EXEC says so."""
    if not isinstance(code, str):
        raise InvalidArgument(f"the candidate code must be a str, not {type(code).__name__}")
    early = None if checked else verdict_without_sandbox(code)
    if early is not None:
        return early
    if one_exec and ONE_EXEC:
        result = _grade_one_exec(sandbox, code, spec, seed)
        if result is not None:
            return result
        sandbox.reset()  # the output cap cut the verdict off: grade again, in two execs
    return _grade_two_execs(sandbox, code, spec, seed)


def _grade_one_exec(sandbox, code: str, spec, seed: str | None) -> GradeResult | None:
    """Grade in one exec: the candidate's top-level code, then (if it ended with status 0) the
    tests, each as the two-exec grade runs them (see harness.py `run`), so that a grade costs
    one round trip to the sandbox instead of two. The tests and the sealed token are in the
    sandbox while the candidate's top-level code runs, as the tests are while the candidate's
    functions are called: in the grader's frame, not in the candidate's namespace. The exec's
    budget is timeout_seconds for the candidate and the tests together (two execs gave each
    phase its own: a candidate whose top level and tests each fit but together do not now
    times out; an endless loop still costs one timeout_seconds). None when the engine's output cap cut the
    exec's output before a verdict (a candidate that printed about OUTPUT_CAP): the caller grades
    it again in two execs, where the verdict has an output of its own."""
    nonce = secrets.token_hex(16)
    token = "__collimate_verdict_" + nonce + ":"
    seed = seed if seed is not None else fresh_seed()
    phase = secrets.token_hex(16)
    candidate = (code, seed, phase)
    if isinstance(spec, PropertyReward):
        harness, n = _property_harness(spec, nonce, seed, candidate), spec.trials
    else:
        harness, n = _harness(nonce, spec, candidate)
    r = sandbox.exec(code=harness, timeout_seconds=spec.timeout_seconds, seed=seed)
    marker = "\n__collimate_phase_" + phase + "\n"
    head, found, tail = r.stdout.partition(marker)
    out = head + tail
    common = dict(stdout=out, stderr=r.stderr, seed=r.seed, seed_ack=r.seed_ack, duration=r.duration)
    if not found:  # the candidate's top-level code did not finish with status 0
        if r.timed_out:  # a timeout in either phase is 0.0 (and an output flood is one)
            return GradeResult(0.0, "timeout", **common)
        if r.truncated:
            return None
        if r.interpreter_died:
            return GradeResult(0.0, f"the candidate ended the interpreter (exit code {r.exit_code})", **common)
        if r.exit_code != 0:
            return GradeResult(0.0, f"the candidate failed (exit code {r.exit_code})", **common)
        # Status 0 without the line: the candidate hid it (it ran against this harness).
        return GradeResult(0.0, "no verdict (the program ended or hid the harness's report)", **common)
    if r.timed_out:
        return GradeResult(0.0, "timeout in the tests", **common)
    verdict = _verdict(tail, token)
    if verdict is None and r.truncated:
        return None
    return _scored(verdict, n, spec, common)


def _scored(verdict: list[bool] | None, n: int, spec, common: dict) -> GradeResult:
    if verdict is None or len(verdict) != n:
        return GradeResult(0.0, "no verdict (the program ended or hid the harness's report)", **common)
    passed = sum(verdict)
    partial = getattr(spec, "partial_credit", False)
    reward = passed / n if partial else (1.0 if passed == n else 0.0)
    reason = "passed" if passed == n else f"{n - passed} of {n} failed"
    return GradeResult(reward, reason, verdict, **common)


def _grade_two_execs(sandbox, code: str, spec, seed: str | None) -> GradeResult:
    """Grade in two execs: the candidate's, then the tests' (which the candidate never sees)."""
    nonce = secrets.token_hex(16)
    token = "__collimate_verdict_" + nonce + ":"
    timeout = spec.timeout_seconds
    r1 = sandbox.exec(code=code, timeout_seconds=timeout, seed=seed)
    if r1.timed_out:
        return GradeResult(0.0, "timeout", stdout=r1.stdout, stderr=r1.stderr, seed=r1.seed, seed_ack=r1.seed_ack, duration=r1.duration)
    if r1.interpreter_died:  # os._exit(0) too: the tests would run in a fresh interpreter
        return GradeResult(0.0, f"the candidate ended the interpreter (exit code {r1.exit_code})", stdout=r1.stdout,
                           stderr=r1.stderr, seed=r1.seed, seed_ack=r1.seed_ack, duration=r1.duration)
    if r1.exit_code != 0:
        return GradeResult(0.0, f"the candidate failed (exit code {r1.exit_code})", stdout=r1.stdout, stderr=r1.stderr,
                           seed=r1.seed, seed_ack=r1.seed_ack, duration=r1.duration)
    # Only now, with the candidate's top-level code done, do the tests and the token exist in the
    # sandbox.
    if isinstance(spec, PropertyReward):
        harness, n = _property_harness(spec, nonce, r1.seed), spec.trials
    else:
        harness, n = _harness(nonce, spec)
    r2 = sandbox.exec(code=harness, timeout_seconds=timeout, seed=r1.seed)
    out, err = r1.stdout + r2.stdout, r1.stderr + r2.stderr
    dur = r1.duration + r2.duration
    if r2.timed_out:
        return GradeResult(0.0, "timeout in the tests", stdout=out, stderr=err, seed=r1.seed, seed_ack=r1.seed_ack, duration=dur)
    verdict = _verdict(r2.stdout, token)
    return _scored(verdict, n, spec, dict(stdout=out, stderr=err, seed=r1.seed, seed_ack=r1.seed_ack, duration=dur))


def _prepare(sandbox, spec, preload: Sequence[str] = ()) -> None:
    """Before any candidate: the spec's setup, then the grader."""
    if getattr(spec, "setup", None):
        r = sandbox.exec(code=spec.setup, timeout_seconds=spec.timeout_seconds)
        if not r.ok:
            raise InvalidArgument(f"the spec's setup failed (exit {r.exit_code}): {r.stderr[-500:]}")
    r = sandbox.exec(code=_prelude(preload), timeout_seconds=max(30.0, spec.timeout_seconds))
    if not r.ok:
        raise EngineError(f"installing the grader in the sandbox failed (exit {r.exit_code}): {r.stderr[-500:]}")


def _preload(specs) -> list[str]:
    return sorted(set(_BASE_PRELOAD) | {m for s in set(specs) for m in _spec_imports(s)})


def _prepared_template(client: Any, spec, preload: list[str]) -> str | None:
    """The name of a template holding spec.template + spec.setup + the grader (see
    pool.py), or None when the client cannot host one."""
    prelude_key = hashlib.sha256(_prelude(preload).encode()).hexdigest()
    return _grading_pool.prepared(client, spec.template, getattr(spec, "setup", None), preload, prelude_key,
                                  lambda sb: _prepare(sb, spec, preload))


def _is_io(spec: Any) -> bool:
    from collimate_core.grading.iotest import IOTestReward

    return isinstance(spec, IOTestReward)


def _client(client: Any) -> Any:
    from collimate_core.sdk.client import connect

    return client if client is not None else connect()


def grade(code: str, spec: "UnitTestReward | PropertyReward | IOTestReward", *, client: Any = None, seed: str | None = None) -> GradeResult:
    """Grade one candidate in an isolated clone of spec.template (with spec.setup and the grader
    installed: on the embedded engine, a template prepared on the first grade and reused)."""
    from collimate_core.sdk.session import Sandbox

    if _is_io(spec):  # stdin/stdout cases: iotest.py, through grade_many
        from collimate_core.grading.grade_many import grade_many

        (result,) = grade_many([(code, spec)], client=client, seed=seed, return_exceptions=True)
        if isinstance(result, BaseException):
            raise result  # as grade raises for the other specs: the failure itself
        return result
    spec._parts()  # bad specs fail before anything runs
    if seed is None and isinstance(spec, PropertyReward) and spec.seed:
        seed = spec.seed
    if seed is not None:
        seed = parse_seed(seed).hex()
    client = _client(client)
    preload = _preload([spec])
    name = _prepared_template(client, spec, preload)
    if name is not None:
        with Sandbox(name, client=client) as sb:
            return _grade_in(sb, code, spec, seed, one_exec=True)
    with Sandbox(spec.template, client=client) as sb:
        _prepare(sb, spec, preload)
        return _grade_in(sb, code, spec, seed)


def _specs_for(spec: Any, n: int) -> list:
    """One spec per candidate: `spec` itself, or a sequence of n specs that share a template and
    a setup (they are graded from one prepared state)."""
    if isinstance(spec, (UnitTestReward, PropertyReward)):
        spec._parts()
        return [spec] * n
    if isinstance(spec, (str, bytes)) or not hasattr(spec, "__len__"):
        raise InvalidArgument(
            f"grade_batch takes a UnitTestReward or PropertyReward, or a list of them, not {type(spec).__name__}"
        )
    specs = list(spec)
    if len(specs) != n:
        raise InvalidArgument(
            f"grade_batch got {n} candidates and {len(specs)} specs; give one spec, or one per candidate"
        )
    for s in specs:
        if not isinstance(s, (UnitTestReward, PropertyReward)):
            raise InvalidArgument(f"grade_batch specs must be UnitTestReward or PropertyReward, not {type(s).__name__}")
        s._parts()
    if specs and len({(s.template, getattr(s, "setup", None)) for s in specs}) != 1:
        raise InvalidArgument(
            "the specs of one grade_batch must share their template and setup (they are graded from one prepared state)"
        )
    return specs


def _default_workers(n: int) -> int:
    # A candidate keeps about one core busy from its clone to its verdict; one worker more than
    # the cores keeps them busy while a reply or a reset is in flight (on 2 cores, 3 workers
    # graded 64 candidates fastest of 1 to 4; benches/bench_grading.py).
    return max(1, min(n, (os.cpu_count() or 2) + 1))


def grade_batch(
    codes: Sequence[str],
    spec: UnitTestReward | PropertyReward | Sequence[UnitTestReward | PropertyReward],
    *,
    client: Any = None,
    seed: str | None = None,
    max_workers: int | None = None,
) -> list[GradeResult]:
    """Grade a GRPO group, `max_workers` candidates at a time (default: the host's cores + 1), each
    in its own isolated sandbox. The template's clone, the spec's setup and the grader's
    installation are paid once: on the embedded engine, in a template prepared on first use (and
    reused by later grades of the same template and setup), whose clones are forked from its
    zygote or recycled by reset; elsewhere, in a parent sandbox that each candidate's child is
    forked from. Results are positional. Every candidate of the group runs with the same seed
    (common random numbers), recorded in each result.

    `spec` may also be a list of specs, one per candidate (e.g. the problems of a benchmark),
    sharing one template and setup. An infrastructure failure of any child raises GroupError
    (no partial results)."""
    from collimate_core.sdk.session import Sandbox

    codes = list(codes)
    if _is_io(spec) or (not isinstance(spec, (str, bytes, UnitTestReward, PropertyReward)) and hasattr(spec, "__len__")
                        and any(_is_io(s) for s in spec)):
        # stdin/stdout cases (iotest.py): one spec, or one per candidate, through grade_many.
        from collimate_core.grading.grade_many import grade_many

        specs = [spec] * len(codes) if _is_io(spec) else list(spec)
        if len(specs) != len(codes):
            raise InvalidArgument(
                f"grade_batch got {len(codes)} candidates and {len(specs)} specs; give one spec, or one per candidate")
        return grade_many(list(zip(codes, specs)), client=client, seed=seed, max_workers=max_workers)
    specs = _specs_for(spec, len(codes))
    if not codes:
        return []
    first = specs[0]
    if seed is not None:
        base = parse_seed(seed).hex()
    elif isinstance(first, PropertyReward) and first.seed:
        base = parse_seed(first.seed).hex()
    else:
        base = fresh_seed()
    workers = _default_workers(len(codes)) if max_workers is None else int(max_workers)
    if workers < 1:
        raise InvalidArgument(f"max_workers must be >= 1, not {max_workers!r}")
    client = _client(client)
    preload = _preload(specs)
    name = _prepared_template(client, first, preload)
    results: list[GradeResult | None] = [None] * len(codes)
    failure: list[tuple[int, BaseException]] = []
    order = itertools.count()
    lock = threading.Lock()

    def grade_one(parent, i: int) -> GradeResult:
        if parent is None:  # a clone of the prepared template
            with Sandbox(name, client=client) as sb:
                return _grade_in(sb, codes[i], specs[i], base, one_exec=True)
        with parent.fork_group(1, seed=base) as grp:  # a child of the prepared parent
            return _grade_in(grp[0], codes[i], specs[i], base)

    def work(parent) -> None:
        while True:
            with lock:
                if failure:
                    return
                i = next(order)
            if i >= len(codes):
                return
            try:
                results[i] = grade_one(parent, i)
            except BaseException as e:  # noqa: BLE001 - re-raised by grade_batch after the others stop
                with lock:
                    failure.append((i, e))
                return

    def fan_out(parent) -> None:
        threads = [threading.Thread(target=work, args=(parent,), name=f"collimate-grade-{k}", daemon=True)
                   for k in range(min(workers, len(codes)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    if name is not None:
        fan_out(None)
    else:
        with Sandbox(first.template, client=client) as parent:
            _prepare(parent, first, preload)
            fan_out(parent)
    raise_first_failure(failure, len(codes), "group")
    return results  # type: ignore[return-value]


def raise_first_failure(failure: list, total: int, what: str) -> None:
    """Raise the failure of the lowest-numbered candidate, if any: an infrastructure failure as a
    GroupError (no rewards are returned: never score a lost sandbox), bad input as itself."""
    if not failure:
        return
    i, e = min(failure, key=lambda f: f[0])
    if isinstance(e, CollimateError) and not isinstance(e, InvalidArgument):
        raise GroupError(
            f"grading candidate {i} of {total} failed ({e}); no rewards were returned, resample the {what}"
        ) from e
    raise e


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
