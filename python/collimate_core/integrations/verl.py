"""veRL: custom reward functions (`custom_reward_function.path` = this file's module, `name` =
`compute_score`, or `compute_score_async`; `compute_score_batch` for veRL's batch reward manager).

veRL calls `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)` per
response (the reward manager passes them as keywords; `custom_reward_function.reward_kwargs` arrive
in **kwargs), and takes a float back. `ground_truth` is what the dataset's reward model field holds:
for code, sandbox-fusion style stdin/stdout cases, `{"inputs": [...], "outputs": [...]}` (a dict or
its JSON string; a list of {"input", "output"} dicts too), or test code (a string of asserts).

Spec options come from the keyword arguments when they name one (time_limit_seconds,
memory_limit_mb, float_tolerance, partial_credit, ...; others are ignored), and so do `client`
and `on_infra_error` ("raise", the default, or "none": an infrastructure failure scores None).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any, Sequence

from collimate_core.grading.grade import UnitTestReward
from collimate_core.grading.iotest import IOTestReward
from collimate_core.integrations import score_specs, spec_from_tests

__all__ = ["compute_score", "compute_score_async", "compute_score_batch"]

_SPEC_OPTIONS = ({f.name for f in dataclasses.fields(IOTestReward)} | {f.name for f in dataclasses.fields(UnitTestReward)}) \
    - {"cases", "tests"}
_client_lock = threading.Lock()
_default_client: list[Any] = []


def _client(kwargs: dict) -> Any:
    if kwargs.get("client") is not None:
        return kwargs["client"]
    with _client_lock:
        if not _default_client:
            from collimate_core.sdk.client import connect

            _default_client.append(connect())
        return _default_client[0]


def _options(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k in _SPEC_OPTIONS}


def compute_score_batch(
    data_sources: Sequence[Any],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Scores for a batch of responses, graded together (grade_many)."""
    opts = _options(kwargs)
    specs = [spec_from_tests(gt, None, **opts) for gt in ground_truths]
    return score_specs(specs, list(solution_strs), client=_client(kwargs),
                       on_infra_error=kwargs.get("on_infra_error", "raise"), language=kwargs.get("language", "python"))


def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None,
                  **kwargs: Any) -> float | None:
    """The score of one response: 1.0 / 0.0, or the fraction of cases passed with partial_credit."""
    return compute_score_batch([data_source], [solution_str], [ground_truth], [extra_info], **kwargs)[0]


async def compute_score_async(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None,
                              **kwargs: Any) -> float | None:
    """compute_score as an `async def` (graded in a worker thread)."""
    return await asyncio.to_thread(compute_score, data_source, solution_str, ground_truth, extra_info, **kwargs)
