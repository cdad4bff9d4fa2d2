"""stdin/stdout grading: IOTestReward, the way competitive-programming datasets test programs.

How a candidate is graded, in one sandbox (a clone of a prepared template, see pool.py):
- Before any candidate, the template gets the spec's setup and the runner (iotest_guest.py):
  the common modules imported, the process cap set. The cases are not part of that prepared
  state, so every spec of a template and setup shares one prepared template: a batch where each
  prompt brings its own tests prepares nothing new.
- Each case is one exec whose program is the candidate, run as a fresh interpreter's main program
  with fd 0 reading the case's input. The exec's host-side timeout is the case's time limit; its
  stdout is the program's output and its exit code the program's status. The sandbox is reset to
  the prepared state after every case, so the cases run alike and in isolation (on a client that
  cannot host templates: a fresh child of a prepared parent per case).
- The output is compared on the host (expected outputs never enter the sandbox), unless the spec
  has a checker: then, after the cases, the checker runs in the sandbox reset once more (no
  candidate code ran in that state) over (input, output, expected), and reports one verdict line
  tagged with a per-grade token.

Verdicts per case: "ok", "wrong_answer" (also: output over the exec's 16 MiB capture), "runtime_error"
(a nonzero exit status, a signal, a syntax error), "time_limit" (the exec ran out of time),
"memory_limit" (a MemoryError, or heap in use over the limit at a garbage-collector pass or at
exit) and "skipped" (not run: an earlier case failed and the spec stops at the first failure).

A candidate has nothing to forge: it never sees an expected output, and what decides a case is
what the host captured (its stdout, its exit status, the host's clock). An infrastructure failure
(the sandbox died, the engine failed) raises and is never scored; a case that ended without the
agent's reply (a timeout, a signal) is scored only once the sandbox answers again.

Known limits: the memory limit is the runner's, not the engine's (the engine has no RLIMIT_AS): a
program that flushes its answer and leaves with os._exit between garbage-collector passes escapes
the check at exit. Threads are not supported in a sandbox, so a solution that runs its main in a
threading.Thread (for a bigger stack) fails with a runtime error.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import math
import secrets
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from collimate_core.sdk.errors import EngineError, InvalidArgument
from collimate_core.grading.grade import GradeResult, installer

__all__ = ["IOGradeResult", "IOTestReward", "outputs_match"]

VERDICTS = ("ok", "wrong_answer", "runtime_error", "time_limit", "memory_limit", "skipped")
MEMORY_EXIT = 203  # iotest_guest.MEMORY_EXIT
_RUN = "__collimate_io_run"
# A case's stdin above this many bytes is uploaded to _STDIN_UPLOAD instead of sent in code=.
_INLINE_STDIN = 256 << 10
_STDIN_UPLOAD = "/tmp/.collimate-stdin-upload"
_CHECK = "__collimate_io_check"
# Imported before any candidate in every stdin/stdout grading sandbox: what solutions to such
# problems commonly import (a candidate's import of them is then a lookup).
_IO_PRELOAD = ("array", "bisect", "collections", "copy", "decimal", "fractions", "functools", "heapq", "io",
               "itertools", "json", "math", "operator", "random", "re", "statistics", "string", "sys", "typing")
_KEEP = 64 << 10  # bytes of a case's stdout/stderr kept in the result


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _token_eq(a: str, b: str, tol: float | None) -> bool:
    if a == b:
        return True
    if tol is None:
        return False
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    if math.isnan(x) or math.isnan(y):
        return False
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(x - y) <= tol or abs(x - y) <= tol * abs(y)


def outputs_match(output: str, expected: str, *, float_tolerance: float | None = None, tokens: bool = False) -> bool:
    """Whether a program's output answers `expected`, as the checkers of APPS- and
    CodeContests-style datasets compare: line ends (\\r\\n, \\r) and trailing whitespace on each
    line and at the end are ignored; with `tokens`, any whitespace separates tokens; with
    `float_tolerance`, tokens that are both numbers may differ by that much (absolute, or relative to
    the expected value)."""
    a, b = _lines(output), _lines(expected)
    if tokens:
        ta, tb = " ".join(a).split(), " ".join(b).split()
        return len(ta) == len(tb) and all(_token_eq(x, y, float_tolerance) for x, y in zip(ta, tb))
    if a == b:
        return True
    if float_tolerance is None or len(a) != len(b):
        return False
    for la, lb in zip(a, b):
        ta, tb = la.split(), lb.split()
        if len(ta) != len(tb) or not all(_token_eq(x, y, float_tolerance) for x, y in zip(ta, tb)):
            return False
    return True


def _checker_source(checker: Any) -> tuple[str | None, str]:
    """(source, function name) of a checker: source text defining `check`, or a module-level
    function (its source is sent; it runs in the sandbox, never on the host)."""
    if checker is None:
        return None, "check"
    if isinstance(checker, str):
        try:
            tree = ast.parse(checker)
        except SyntaxError as e:
            raise InvalidArgument(f"IOTestReward.checker does not parse: {e}") from None
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        if "check" not in defined:
            raise InvalidArgument("IOTestReward.checker source must define check(input, output, expected)")
        return checker, "check"
    if callable(checker) and getattr(checker, "__name__", "<lambda>").isidentifier() and checker.__name__ != "<lambda>":
        if getattr(checker, "__closure__", None):
            raise InvalidArgument("IOTestReward.checker must not close over variables: it runs in the sandbox")
        try:
            src = textwrap.dedent(inspect.getsource(checker))
        except (OSError, TypeError) as e:
            raise InvalidArgument(f"IOTestReward.checker: no source for {checker!r} ({e}); give its source text") from None
        if checker.__name__ != "check":
            src += f"\n\ncheck = {checker.__name__}\n"
        return src, "check"
    raise InvalidArgument("IOTestReward.checker takes source defining check(input, output, expected), or a def'd function")


@dataclass(frozen=True)
class IOTestReward:
    """Run the candidate as a program once per case: `cases` is a sequence of (stdin, expected
    stdout) pairs (str). Each case runs in the candidate's sandbox reset to the prepared state,
    within `time_limit_seconds` (host clock) and `memory_limit_mb` (heap in use, see iotest_guest.py).

    The output is compared as outputs_match does (line ends and trailing whitespace ignored;
    `tokens`: any whitespace; `float_tolerance`: numbers within it), or by `checker`: source
    defining `check(input, output, expected) -> bool` (or a module-level function, whose source is
    taken), run in the sandbox after the cases, never on the host. reward = 1.0 when every case is
    "ok", else 0.0; with partial_credit the fraction of cases that are. By default grading stops
    at the first failing case (the rest are "skipped") unless partial_credit is set.

    `setup`: Python run once in the prepared state, before any candidate (e.g. writing the files a
    program reads, importing what it needs); its names are not the program's, which starts in a
    fresh __main__.

    reset_between_cases=False runs each case after the first where the previous one left off
    (faster: no reset and no first touches of a reset sandbox; a case's files, module state and
    leftover processes are then visible to the next). The expected outputs stay on the host
    either way.
    """

    cases: Sequence[tuple[str, str]] = ()
    template: str = "python"
    time_limit_seconds: float = 4.0
    memory_limit_mb: float | None = 512.0
    float_tolerance: float | None = None
    tokens: bool = False
    checker: Any = None
    partial_credit: bool = False
    stop_on_failure: bool | None = None
    setup: str | None = None
    reset_between_cases: bool = True

    def __post_init__(self) -> None:
        cases = self.cases
        if isinstance(cases, (str, bytes)) or not hasattr(cases, "__iter__"):
            raise InvalidArgument("IOTestReward.cases takes a sequence of (stdin, expected_stdout) pairs")
        norm = []
        for c in cases:
            if isinstance(c, dict):
                c = (c.get("input", c.get("stdin")), c.get("output", c.get("expected", c.get("stdout"))))
            if not (isinstance(c, (tuple, list)) and len(c) == 2 and all(isinstance(x, str) for x in c)):
                raise InvalidArgument(f"each IOTestReward case is a (stdin, expected_stdout) pair of str, not {c!r:.80}")
            norm.append((c[0], c[1]))
        object.__setattr__(self, "cases", tuple(norm))
        if self.checker is not None:
            object.__setattr__(self, "checker", _checker_source(self.checker)[0])

    # The attribute grade.py's preparation reads for its own timeouts.
    @property
    def timeout_seconds(self) -> float:
        return max(30.0, float(self.time_limit_seconds))

    def _parts(self) -> list[str]:
        if not self.cases:
            raise InvalidArgument("IOTestReward.cases is empty: give at least one (stdin, expected_stdout) pair")
        t = self.time_limit_seconds
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t <= 3600):
            raise InvalidArgument(f"IOTestReward.time_limit_seconds must be in (0, 3600], not {t!r}")
        m = self.memory_limit_mb
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or m <= 0):
            raise InvalidArgument(f"IOTestReward.memory_limit_mb must be a positive number or None, not {m!r}")
        f = self.float_tolerance
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or f < 0):
            raise InvalidArgument(f"IOTestReward.float_tolerance must be a number >= 0 or None, not {f!r}")
        if self.checker is not None:
            _checker_source(self.checker)
        return [f"case {k}" for k in range(len(self.cases))]


@dataclass(frozen=True)
class IOGradeResult(GradeResult):
    """A GradeResult with one verdict per case (see VERDICTS) and each case's exec duration.
    `passed[k]` is verdicts[k] == "ok"; stdout/stderr are the first failing case's (else the last
    case's), at most 64 KiB each."""

    verdicts: list[str] = field(default_factory=list)
    case_durations: list[float] = field(default_factory=list)


_GUEST_SOURCE: str | None = None


def _prelude(preload: Sequence[str]) -> str:
    global _GUEST_SOURCE
    if _GUEST_SOURCE is None:
        _GUEST_SOURCE = (Path(__file__).resolve().parent / "iotest_guest.py").read_text()
    return installer(_GUEST_SOURCE, "io", preload, f"{_RUN}, {_CHECK}")


def _preload(specs: Sequence[IOTestReward]) -> list[str]:
    return sorted(set(_IO_PRELOAD))


def _prepare(sandbox: Any, spec: IOTestReward, preload: Sequence[str]) -> None:
    if spec.setup:
        r = sandbox.exec(code=spec.setup, timeout_seconds=spec.timeout_seconds)
        if not r.ok:
            raise InvalidArgument(f"the spec's setup failed (exit {r.exit_code}): {r.stderr[-500:]}")
    r = sandbox.exec(code=_prelude(preload), timeout_seconds=60.0)
    if not r.ok:
        raise EngineError(f"installing the stdin/stdout runner in the sandbox failed (exit {r.exit_code}): {r.stderr[-500:]}")


def prepared_template(client: Any, spec: IOTestReward) -> str | None:
    """The template holding spec.template + spec.setup + the runner (one per template and setup,
    whatever the cases), or None when the client cannot host one."""
    from collimate_core.grading import pool as _grading_pool

    preload = _preload([spec])
    key = hashlib.sha256(_prelude(preload).encode()).hexdigest()
    return _grading_pool.prepared(client, spec.template, spec.setup, preload, key,
                                  lambda sb: _prepare(sb, spec, preload))


class _TemplateCases:
    """Case sandboxes from a prepared template: one clone, reset to the prepared state before every
    case after the first (and before the checker)."""

    def __init__(self, client: Any, name: str):
        from collimate_core.sdk.session import Sandbox

        self._sb = Sandbox(name, client=client)
        self._used = False

    def __enter__(self) -> "_TemplateCases":
        self._sb.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sb.kill()

    def exec_fresh(self, reset: bool = True, upload: tuple[str, bytes] | None = None, **kw: Any):
        if self._used and reset:
            self._sb.reset()
        self._used = True
        if upload is not None:
            self._sb.upload_bytes(*upload)
        return self._sb.exec(**kw)

    def check_alive(self) -> None:
        """After a case that ended without the agent's reply (a timeout, a signal): the sandbox
        must still answer, or what looked like the candidate's failure was the sandbox dying (a
        VMM process killed from outside reports as a timeout); that raises, it is never scored."""
        r = self.exec_fresh(code="pass", timeout_seconds=30.0)
        if not r.ok:
            raise EngineError(f"the sandbox does not answer after a case (exit {r.exit_code}): {r.stderr[-300:]}")


class _ForkedCases:
    """Case sandboxes on a client without templates: a fresh child of the prepared parent per exec."""

    def __init__(self, parent: Any, seed: str):
        self._parent, self._seed = parent, seed

    def __enter__(self) -> "_ForkedCases":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def exec_fresh(self, reset: bool = True, upload: tuple[str, bytes] | None = None, **kw: Any):
        with self._parent.fork_group(1, seed=self._seed) as grp:
            if upload is not None:
                grp[0].upload_bytes(*upload)
            return grp[0].exec(**kw)

    def check_alive(self) -> None:
        pass  # each case had a child of its own; the parent answers for the next fork


def _seal(nonce: str) -> list[str]:
    key = secrets.token_hex(16)
    return [key, format(int(nonce, 16) ^ int(key, 16), "032x")]


def _tail(s: str) -> str:
    return s if len(s) <= _KEEP else s[-_KEEP:]


def _classify(r: Any) -> str | None:
    """A case's verdict from its exec, or None when its output decides."""
    if r.timed_out:
        return "time_limit"
    if r.exit_code == MEMORY_EXIT:
        return "memory_limit"
    if r.exit_code != 0:
        return "runtime_error"
    if r.truncated:
        return "wrong_answer"
    return None


def _stdout_text(r: Any) -> str:
    data = getattr(r, "stdout_bytes", b"") or b""
    return data.decode("utf-8", errors="replace") if data else r.stdout


def without_sandbox(code: str, spec: IOTestReward) -> IOGradeResult | None:
    """The result of a candidate that needs no sandbox (no code, a syntax error), else None."""
    if not isinstance(code, str):
        raise InvalidArgument(f"the candidate code must be a str, not {type(code).__name__}")
    n = len(spec.cases)
    if not code.strip():
        return IOGradeResult(0.0, "no code to grade", [False] * n, verdicts=["skipped"] * n, case_durations=[0.0] * n)
    try:
        compile(code, "solution.py", "exec")
    except (SyntaxError, ValueError) as e:
        return IOGradeResult(0.0, f"syntax error: {e}", [False] * n, verdicts=["runtime_error"] * n,
                             case_durations=[0.0] * n)
    return None


def grade_io_in(cases_box: Any, code: str, spec: IOTestReward, seed: str | None) -> IOGradeResult:
    """Grade `code` on every case of `spec` in `cases_box` (_TemplateCases or _ForkedCases)."""
    static = without_sandbox(code, spec)
    if static is not None:
        return static
    n = len(spec.cases)
    stop = (not spec.partial_credit) if spec.stop_on_failure is None else bool(spec.stop_on_failure)
    limit = None if spec.memory_limit_mb is None else int(spec.memory_limit_mb * (1 << 20))
    verdicts: list[str | None] = []
    durations: list[float] = []
    outputs: dict[int, str] = {}
    shown: tuple[str, str] | None = None
    used_seed, ack = "", ""
    abnormal = False
    for k, (stdin, expected) in enumerate(spec.cases):
        data = stdin.encode("utf-8", "surrogateescape")
        # A large input goes in as a file (an exec's code= has a size limit); the guest reads it
        # from there as it would from the inline bytes.
        upload = (_STDIN_UPLOAD, data) if len(data) > _INLINE_STDIN else None
        call = f"{_RUN}({code!r}, {(_STDIN_UPLOAD if upload else data)!r}, {limit!r})\n"
        # Without reset_between_cases, the next case runs where this one left off, unless it ended
        # without the agent's reply (then the sandbox is reset anyway).
        reset = spec.reset_between_cases or k == 0 or abnormal
        r = cases_box.exec_fresh(reset=reset, upload=upload, code=call,
                                 timeout_seconds=float(spec.time_limit_seconds), seed=seed)
        abnormal = r.timed_out or r.exit_code >= 128
        used_seed, ack = used_seed or r.seed, ack or r.seed_ack
        v = _classify(r)
        out = _stdout_text(r)
        if v is None:
            if spec.checker is not None:
                outputs[k] = out
            else:
                v = "ok" if outputs_match(out, expected, float_tolerance=spec.float_tolerance, tokens=spec.tokens) \
                    else "wrong_answer"
        verdicts.append(v)
        durations.append(r.duration)
        if v not in (None, "ok") and shown is None:
            shown = (_tail(out), _tail(r.stderr))
        if k == n - 1 and shown is None:
            shown = (_tail(out), _tail(r.stderr))
        if stop and v not in (None, "ok"):
            break
    last = verdicts[-1] if verdicts else None
    if last == "time_limit" or (last in ("runtime_error", "memory_limit") and r.exit_code >= 128):
        cases_box.check_alive()
    if outputs:
        nonce = secrets.token_hex(16)
        token = "__collimate_verdict_" + nonce + ":"
        items = [(spec.cases[k][0], outputs[k], spec.cases[k][1]) for k in sorted(outputs)]
        call = f"{_CHECK}({_seal(nonce)!r}, {spec.checker!r}, 'check', {items!r})\n"
        r = cases_box.exec_fresh(code=call, timeout_seconds=max(30.0, float(spec.time_limit_seconds) * len(items)),
                                 seed=seed)
        from collimate_core.grading.grade import _verdict

        got = _verdict(r.stdout, token)
        if got is None or len(got) != len(items):
            raise InvalidArgument(
                f"the spec's checker gave no verdict (exit {r.exit_code}{', timed out' if r.timed_out else ''}): "
                f"{r.stderr[-500:]}")
        for k, ok in zip(sorted(outputs), got):
            verdicts[k] = "ok" if ok else "wrong_answer"
            if not ok and stop:
                # Cases after the first wrong answer count as not run, as without a checker.
                for j in range(k + 1, len(verdicts)):
                    verdicts[j] = "skipped"
                break
    final = [v or "wrong_answer" for v in verdicts] + ["skipped"] * (n - len(verdicts))
    durations += [0.0] * (n - len(durations))
    passed = [v == "ok" for v in final]
    ok = sum(passed)
    reward = ok / n if spec.partial_credit else (1.0 if ok == n else 0.0)
    if ok == n:
        reason = "passed"
    else:
        first = next(k for k, v in enumerate(final) if v != "ok")
        reason = f"{n - ok} of {n} cases failed (case {first}: {final[first]})"
    out, err = shown or ("", "")
    return IOGradeResult(reward, reason, passed, out, err, used_seed, ack, sum(durations),
                         verdicts=final, case_durations=durations)


def grade_io_one(client: Any, name: str | None, parent: Any, code: str, spec: IOTestReward, seed: str) -> IOGradeResult:
    """One candidate in its own sandbox: a clone of the prepared template `name`, or (name None)
    children of the prepared `parent`."""
    static = without_sandbox(code, spec)
    if static is not None:
        return static
    box = _TemplateCases(client, name) if name is not None else _ForkedCases(parent, seed)
    with box:
        return grade_io_in(box, code, spec, seed)
