"""Trainer integrations: rows of a dataset, each with its own tests, to rewards.

- `spec_from_tests(tests, kind=...)`: a row's tests column to a spec: test code (kind "unit"; also
  a list of assert statements, as MBPP's test_list), or
  stdin/stdout cases (kind "io": `{"inputs": [...], "outputs": [...]}` as a dict or a JSON string,
  as sandbox-fusion and the APPS/TACO/DeepCoder datasets store them, or a list of (stdin, stdout)
  pairs or of {"input", "output"} dicts). kind None tells them apart.
- `score_rows(rows, completions)`: the trainer-agnostic entry point: one row (a dict holding the
  tests, or a spec) and one completion each, graded in one grade_many call.
- `collimate_core.integrations.trl.reward_func`: for TRL's GRPOTrainer(reward_funcs=[...]).
- `collimate_core.integrations.verl.compute_score`: veRL's custom reward function.

Infrastructure failures raise by default; with on_infra_error="none" those rows score None (TRL
turns None into NaN and leaves them out). A bad tests column raises InvalidArgument either way.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Sequence

from collimate_core.sdk.errors import InvalidArgument
from collimate_core.grading.grade_many import grade_many
from collimate_core.grading.grade import PropertyReward, UnitTestReward, extract_code
from collimate_core.grading.iotest import IOTestReward

__all__ = ["completion_text", "score_rows", "spec_from_tests"]

_SPECS = (UnitTestReward, PropertyReward, IOTestReward)
_KINDS = ("unit", "io", None)


def completion_text(completion: Any) -> str:
    """The text of a completion: a str, a message dict, or a conversation (a list of
    {"role", "content"} messages; the last assistant message, else the last message)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        content = completion.get("content", "")
        return content if isinstance(content, str) else str(content)
    if isinstance(completion, (list, tuple)):
        msgs = [m for m in completion if isinstance(m, dict)]
        if not msgs:
            return ""
        assistant = [m for m in msgs if m.get("role") == "assistant"]
        return completion_text((assistant or msgs)[-1])
    raise InvalidArgument(f"a completion is a str or a chat-format list of messages, not {type(completion).__name__}")


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _io_cases(value: Any) -> list[tuple[str, str]] | None:
    """stdin/stdout cases in one of the dataset formats, or None when `value` is not one."""
    if isinstance(value, str):
        s = value.strip()
        if not s.startswith(("{", "[")):
            return None
        try:
            value = json.loads(s)
        except ValueError:
            return None
    if isinstance(value, dict):
        if value.get("fn_name"):
            raise InvalidArgument(
                "call-based tests (fn_name) are not stdin/stdout cases: give them as test code (kind='unit')")
        if "inputs" in value and "outputs" in value:
            ins, outs = value["inputs"], value["outputs"]
            if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
                raise InvalidArgument("stdin/stdout tests need lists 'inputs' and 'outputs' of the same length")
            return list(zip(ins, outs))
        return None
    if isinstance(value, (list, tuple)) and value:
        cases = []
        for c in value:
            if isinstance(c, dict):
                if c.get("testtype", "stdin") not in ("stdin", "stdin_stdout"):
                    raise InvalidArgument(f"only stdin/stdout cases can be graded as kind 'io', not testtype {c.get('testtype')!r}")
                c = (c.get("input", c.get("stdin")), c.get("output", c.get("stdout", c.get("expected"))))
            if not (isinstance(c, (list, tuple)) and len(c) == 2):
                return None
            cases.append((c[0], c[1]))
        return cases
    return None


@functools.lru_cache(maxsize=8192)
def _cached_spec(kind: str | None, frozen_tests: str, frozen_kwargs: str, tests_is_str: bool) -> Any:
    tests = frozen_tests if tests_is_str else json.loads(frozen_tests)
    return _build_spec(tests, kind, dict(json.loads(frozen_kwargs)))


def _build_spec(tests: Any, kind: str | None, kwargs: dict) -> Any:
    if kind not in _KINDS:
        raise InvalidArgument(f"kind is 'unit', 'io' or None (tell them apart), not {kind!r}")
    cases = None if kind == "unit" else _io_cases(tests)
    if kind == "io" and cases is None:
        raise InvalidArgument(f"kind 'io' needs stdin/stdout cases ({{'inputs': [...], 'outputs': [...]}}), not {tests!r:.120}")
    if cases is not None:
        for inp, out in cases:
            if not isinstance(inp, str) or not isinstance(out, str):
                raise InvalidArgument(f"stdin/stdout cases are str pairs, not ({inp!r:.40}, {out!r:.40})")
        unknown = set(kwargs) - _fields(IOTestReward)
        if unknown and kind == "io":
            raise InvalidArgument(f"IOTestReward takes no {sorted(unknown)}")
        return IOTestReward(cases=cases, **{k: v for k, v in kwargs.items() if k in _fields(IOTestReward)})
    if isinstance(tests, dict):
        tests = tests.get("tests", tests.get("test", tests.get("test_list")))
    if isinstance(tests, (list, tuple)) and tests and all(isinstance(t, str) for t in tests):
        tests = "\n".join(tests) + "\n"  # a list of assert statements (MBPP's test_list)
    if not isinstance(tests, str):
        raise InvalidArgument(f"unit tests are Python source (str), not {type(tests).__name__}")
    unknown = set(kwargs) - _fields(UnitTestReward)
    if unknown and kind == "unit":
        raise InvalidArgument(f"UnitTestReward takes no {sorted(unknown)}")
    spec = UnitTestReward(tests=tests, **{k: v for k, v in kwargs.items() if k in _fields(UnitTestReward)})
    spec._parts()
    return spec


def spec_from_tests(tests: Any, kind: str | None = None, **spec_kwargs: Any) -> Any:
    """The spec for one row's tests (see the module's docstring); a spec is returned as it is.
    `spec_kwargs` go to the spec (time_limit_seconds, float_tolerance, partial_credit, ...); with
    kind None, each kind takes the ones it has. Specs are cached by their tests, so rows that
    repeat a prompt share one spec."""
    if isinstance(tests, _SPECS):
        return tests
    try:  # cached when the tests and the options are plain data
        kw = json.dumps(sorted(spec_kwargs.items()), sort_keys=True)
        frozen = tests if isinstance(tests, str) else json.dumps(tests, sort_keys=True)
    except (TypeError, ValueError):
        return _build_spec(tests, kind, dict(spec_kwargs))
    return _cached_spec(kind, frozen, kw, isinstance(tests, str))


def _on_infra(value: str) -> str:
    if value not in ("raise", "none"):
        raise InvalidArgument(f"on_infra_error is 'raise' or 'none', not {value!r}")
    return value


def score_specs(
    specs: Sequence[Any],
    completions: Sequence[Any],
    *,
    client: Any = None,
    on_infra_error: str = "raise",
    language: str = "python",
    max_workers: int | None = None,
    seed: str | None = None,
) -> list[float | None]:
    """One reward per (spec, completion), graded in one grade_many call."""
    _on_infra(on_infra_error)
    if len(specs) != len(completions):
        raise InvalidArgument(f"{len(completions)} completions for {len(specs)} rows: give one row per completion")
    codes = [extract_code(completion_text(c), language) for c in completions]
    results = grade_many(list(zip(codes, specs)), client=client, seed=seed, max_workers=max_workers,
                         return_exceptions=on_infra_error == "none")
    out: list[float | None] = []
    for r in results:
        if isinstance(r, InvalidArgument):
            raise r
        out.append(None if isinstance(r, BaseException) else float(r.reward))
    return out


def score_rows(
    rows: Sequence[Any],
    completions: Sequence[Any],
    *,
    tests_key: str = "tests",
    kind: str | None = None,
    client: Any = None,
    on_infra_error: str = "raise",
    language: str = "python",
    max_workers: int | None = None,
    seed: str | None = None,
    **spec_kwargs: Any,
) -> list[float | None]:
    """A reward per completion, for any trainer: `rows[i]` is completion i's row, a dict holding
    its tests under `tests_key` (or the tests themselves, or a spec); `completions[i]` a str or a
    chat-format list. The code is taken from each completion with extract_code."""
    specs = []
    for i, row in enumerate(rows):
        tests = row[tests_key] if isinstance(row, dict) and tests_key in row else row
        if tests is None:
            raise InvalidArgument(f"row {i} has no tests (no {tests_key!r})")
        specs.append(spec_from_tests(tests, kind, **spec_kwargs))
    return score_specs(specs, completions, client=client, on_infra_error=on_infra_error, language=language,
                       max_workers=max_workers, seed=seed)
