"""TRL: a reward function for `GRPOTrainer(reward_funcs=[...])` whose tests come from a dataset column.

TRL calls each reward function with keyword arguments: `prompts`, `completions` (strings, or
conversations: lists of {"role", "content"} messages), `completion_ids`, every other column of the
dataset as a list aligned with the completions (a prompt's row repeated once per generation), and,
in recent versions, `trainer_state`; it expects one float per completion (None: no reward for that
one, which TRL turns into NaN). It runs `async def` reward functions concurrently on an event
loop of its own (any function for which asyncio.iscoroutinefunction holds).

    from collimate_core.integrations.trl import reward_func
    trainer = GRPOTrainer(model=..., train_dataset=ds,            # ds has a "tests" column
                          reward_funcs=[reward_func(tests_column="tests", kind="io")])
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from collimate_core.sdk.errors import InvalidArgument
from collimate_core.integrations import _on_infra, score_specs, spec_from_tests

__all__ = ["async_reward_func", "reward_func"]


def _make(tests_column: str, kind: str | None, client: Any, on_infra_error: str, language: str,
          max_workers: int | None, spec_kwargs: dict) -> Callable[..., list[float | None]]:
    _on_infra(on_infra_error)
    if not isinstance(tests_column, str) or not tests_column:
        raise InvalidArgument(f"tests_column names the dataset column holding each row's tests, not {tests_column!r}")
    state: dict[str, Any] = {"client": client}

    def rewards(prompts: Any = None, completions: Any = None, **columns: Any) -> list[float | None]:
        if completions is None:
            raise InvalidArgument("the reward function needs completions=")
        if tests_column not in columns:
            have = sorted(k for k in columns if k not in ("completion_ids", "trainer_state"))
            raise InvalidArgument(f"the dataset has no column {tests_column!r} (it has {have})")
        tests = list(columns[tests_column])
        completions = list(completions)
        if len(tests) != len(completions):
            raise InvalidArgument(f"{len(completions)} completions and {len(tests)} values of {tests_column!r}")
        if state["client"] is None:
            from collimate_core.sdk.client import connect

            state["client"] = connect()
        specs = [spec_from_tests(t, kind, **spec_kwargs) for t in tests]
        return score_specs(specs, completions, client=state["client"], on_infra_error=on_infra_error,
                           language=language, max_workers=max_workers)

    return rewards


def reward_func(
    tests_column: str = "tests",
    kind: str | None = "unit",
    *,
    client: Any = None,
    on_infra_error: str = "raise",
    language: str = "python",
    max_workers: int | None = None,
    asynchronous: bool = False,
    **spec_kwargs: Any,
) -> Callable[..., Any]:
    """A TRL reward function: each completion's code (extract_code) graded against the spec built
    from its row's `tests_column` (kind "unit": test code; "io": stdin/stdout cases; None: either,
    told apart per row), with `spec_kwargs` (e.g. time_limit_seconds=2, partial_credit=True).
    Completions of one prompt share one spec, and all specs of one template share its prepared
    state (grade_many). With asynchronous=True, an `async def` (graded in a worker thread, so the
    trainer's event loop keeps running)."""
    sync = _make(tests_column, kind, client, on_infra_error, language, max_workers, spec_kwargs)
    name = f"collimate_{kind or 'tests'}_{tests_column}"
    if not asynchronous:
        def collimate_reward(prompts: Any = None, completions: Any = None, **columns: Any) -> list[float | None]:
            return sync(prompts=prompts, completions=completions, **columns)
    else:
        async def collimate_reward(prompts: Any = None, completions: Any = None, **columns: Any) -> list[float | None]:
            return await asyncio.to_thread(sync, prompts=prompts, completions=completions, **columns)

    collimate_reward.__name__ = collimate_reward.__qualname__ = name
    return collimate_reward


def async_reward_func(tests_column: str = "tests", kind: str | None = "unit", **kwargs: Any) -> Callable[..., Any]:
    """reward_func(..., asynchronous=True): an `async def` reward function."""
    return reward_func(tests_column, kind, asynchronous=True, **kwargs)
