"""grade_many: a batch of (code, spec) pairs, each spec its own (the usual RL step: every prompt
brings its tests), graded in one call.

The pairs are grouped by what their prepared state depends on: the kind of spec, its template and
its setup. Each group is prepared once (on the embedded engine: a template of its own, see
pool.py), so candidates of one spec, and of different specs of the same template and
setup, share it; then one pool of workers grades every pair, whatever its group, and the results
come back in input order.

What a group's preparation depends on, so that a new batch of prompts usually prepares nothing:
- stdin/stdout specs (IOTestReward): the template and setup only; the cases arrive per case.
- unit tests and properties: also the modules the tests import (the grader imports them before
  the candidate and undoes a candidate's patching of them). Per client, template and setup this
  set only grows: a batch whose tests import nothing new reuses the template prepared with the
  union of everything seen so far; one that does prepares that union once more.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import ExitStack
from typing import Any, Sequence

from collimate_core.grading import grade as _grading, iotest as _iotest
from collimate_core.sdk.errors import InvalidArgument
from collimate_core.grading.grade import (
    GradeResult,
    PropertyReward,
    UnitTestReward,
    raise_first_failure,
    verdict_without_sandbox,
)
from collimate_core.grading.iotest import IOTestReward
from collimate_core.sdk.seeds import fresh_seed, parse_seed

__all__ = ["grade_many"]

_SPECS = (UnitTestReward, PropertyReward, IOTestReward)
_lock = threading.Lock()
_seen_preload: "weakref.WeakKeyDictionary[Any, dict[tuple, frozenset[str]]]" = weakref.WeakKeyDictionary()


def _unit_preload(client: Any, template: str, setup: str | None, needed: Sequence[str]) -> list[str]:
    """The modules to preload for unit/property specs of (template, setup) on `client`: the union
    of every set asked for so far, so that the prepared template is reused."""
    try:
        with _lock:
            seen = _seen_preload.setdefault(client, {})
            have = seen.get((template, setup), frozenset())
            if not set(needed) <= have:
                have = have | frozenset(needed)
                seen[(template, setup)] = have
            return sorted(have)
    except TypeError:  # a client that takes no weak references: no memory across calls
        return sorted(set(needed))


def _group_key(spec: Any) -> tuple:
    kind = "io" if isinstance(spec, IOTestReward) else "unit"
    return (kind, spec.template, getattr(spec, "setup", None))


def grade_many(
    pairs: Sequence[tuple[str, UnitTestReward | PropertyReward | IOTestReward]],
    *,
    client: Any = None,
    seed: str | None = None,
    max_workers: int | None = None,
    return_exceptions: bool = False,
) -> list[GradeResult | BaseException]:
    """Grade every (code, spec) pair, each candidate in its own sandbox, `max_workers` at a time
    (default: the host's cores + 1); results in input order (an IOGradeResult for a stdin/stdout
    spec). Specs of one template and setup share one prepared state, whatever their tests.

    Every candidate runs with the same seed (common random numbers; a PropertyReward with a seed of
    its own keeps it), recorded in its result. A bad spec raises InvalidArgument before anything
    runs. An infrastructure failure raises GroupError (no partial results), or, with
    return_exceptions, is returned in that pair's place while the others are graded."""
    from collimate_core.sdk.session import Sandbox

    pairs = list(pairs)
    for i, p in enumerate(pairs):
        if not (isinstance(p, (tuple, list)) and len(p) == 2):
            raise InvalidArgument(f"grade_many takes (code, spec) pairs; item {i} is {type(p).__name__}")
        code, spec = p
        if not isinstance(spec, _SPECS):
            raise InvalidArgument(
                f"grade_many specs must be UnitTestReward, PropertyReward or IOTestReward; item {i} is {type(spec).__name__}")
        if not isinstance(code, str):
            raise InvalidArgument(f"the candidate code must be a str; item {i} is {type(code).__name__}")
        spec._parts()
    if not pairs:
        return []
    base = parse_seed(seed).hex() if seed is not None else fresh_seed()
    seeds = [parse_seed(s.seed).hex() if seed is None and isinstance(s, PropertyReward) and s.seed else base
             for _, s in pairs]
    workers = _grading._default_workers(len(pairs)) if max_workers is None else int(max_workers)
    if workers < 1:
        raise InvalidArgument(f"max_workers must be >= 1, not {max_workers!r}")
    client = _grading._client(client)

    groups: dict[tuple, list[int]] = {}
    for i, (_, spec) in enumerate(pairs):
        groups.setdefault(_group_key(spec), []).append(i)

    results: list[Any] = [None] * len(pairs)
    failure: list[tuple[int, BaseException]] = []
    with ExitStack() as stack:
        # Each group's prepared state: a template name, or a prepared parent to fork.
        where: dict[tuple, tuple[str | None, Any]] = {}
        for key, idx in groups.items():
            first = pairs[idx[0]][1]
            try:
                if key[0] == "io":
                    name = _iotest.prepared_template(client, first)
                    prepare = lambda sb, s=first: _iotest._prepare(sb, s, _iotest._preload([s]))  # noqa: E731
                else:
                    preload = _unit_preload(client, first.template, getattr(first, "setup", None),
                                            _grading._preload([pairs[i][1] for i in idx]))
                    name = _grading._prepared_template(client, first, preload)
                    prepare = lambda sb, s=first, pl=preload: _grading._prepare(sb, s, pl)  # noqa: E731
                parent = None
                if name is None:
                    parent = stack.enter_context(Sandbox(first.template, client=client))
                    prepare(parent)
                where[key] = (name, parent)
            except Exception as e:  # noqa: BLE001 - raised below, or returned per pair
                if not return_exceptions or isinstance(e, InvalidArgument):
                    raise
                for i in idx:
                    results[i] = e
        todo = [i for i in range(len(pairs)) if results[i] is None]
        order = iter(todo)
        lock = threading.Lock()

        def grade_one(i: int) -> GradeResult:
            code, spec = pairs[i]
            name, parent = where[_group_key(spec)]
            if isinstance(spec, IOTestReward):
                return _iotest.grade_io_one(client, name, parent, code, spec, seeds[i])
            # What needs no sandbox (as grade._grade_in answers it): no code, a syntax error.
            early = verdict_without_sandbox(code)
            if early is not None:
                return early
            if name is not None:
                with Sandbox(name, client=client) as sb:
                    return _grading._grade_in(sb, code, spec, seeds[i], checked=True, one_exec=True)
            with parent.fork_group(1, seed=seeds[i]) as grp:
                return _grading._grade_in(grp[0], code, spec, seeds[i], checked=True)

        def work() -> None:
            while True:
                with lock:
                    if failure and not return_exceptions:
                        return
                    i = next(order, None)
                if i is None:
                    return
                try:
                    results[i] = grade_one(i)
                except Exception as e:  # noqa: BLE001 - re-raised after the others stop, or returned
                    with lock:
                        if return_exceptions and not isinstance(e, InvalidArgument):
                            results[i] = e
                        else:
                            failure.append((i, e))
                            return
                except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt and the like: stop all
                    with lock:
                        failure.append((i, e))
                    return

        threads = [threading.Thread(target=work, name=f"collimate-grade-many-{k}", daemon=True)
                   for k in range(min(workers, len(todo)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    raise_first_failure(failure, len(pairs), "batch")
    return results

