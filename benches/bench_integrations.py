"""A mixed GRPO step through the TRL adapter, against a subprocess per completion, in the same run.

The step: 8 prompts x 8 completions (tests/test_integrations.py's problems: stdin/stdout, 3 cases
each, a different set per prompt; right and wrong programs, a conversational completion, one
without code), as GRPOTrainer hands it to a reward function (prompts, completions, the "tests"
column as sandbox-fusion JSON, one row per completion).
- collimate: `integrations.trl.reward_func(tests_column="tests", kind="io")`: every completion in its
  own sandbox, each case a fresh run of the program there (grade_many, one prepared template for
  all 8 specs), at the host's cores + 1 workers, then at the cores; then with
  reset_between_cases=False (a completion's cases run one after another in its sandbox).
- subprocess per completion: `/usr/bin/python3 -c DRIVER` per completion (no isolation), the
  driver running the program on each case in that one process, as APPS's own checker does
  (stdin swapped, stdout captured, the same comparison); WORKERS = the cores at a time.
- subprocess per case: `/usr/bin/python3 -c program` per case with the case's stdin (the
  faithful unsandboxed grader: a fresh interpreter per case), WORKERS at a time.
Median, p99 and the ratio to the subprocess-per-completion median are printed; nothing is asserted
about time. The first call of a process prepares the template (checkpointed once per run), which is
done before timing, as a trainer pays it once.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from collimate_core import EmbeddedClient, outputs_match
from collimate_core.integrations import completion_text, trl
from collimate_core.grading.grade import extract_code
from conftest import HOST_PYTHON

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

WORKERS = os.cpu_count() or 2
ROUNDS = 8
_runs: dict[str, list[float]] = {}


def _step():
    from test_integrations import PROBLEMS, fenced

    prompts, completions, tests, want = [], [], [], []
    for k, (name, (cases, right, wrong)) in enumerate(PROBLEMS.items()):
        gt = json.dumps({"inputs": [c[0] for c in cases], "outputs": [c[1] for c in cases]})
        row = [(fenced(right), 1.0), ([{"role": "assistant", "content": fenced(right)}], 1.0), (fenced(right, ""), 1.0),
               (fenced(wrong), 0.0), (fenced("raise RuntimeError('no')"), 0.0), ("I cannot solve this.", 0.0),
               (fenced(right + f"\n# variant {k}"), 1.0), (fenced(f"print({k})"), 0.0)]
        for completion, reward in row:
            prompts.append(f"Solve {name}.")
            completions.append(completion)
            tests.append(gt)
            want.append(reward)
    return prompts, completions, tests, want


PROMPTS, COMPLETIONS, TESTS, WANT = _step()

DRIVER = r'''
import contextlib, io, json, sys
job = json.loads(sys.stdin.read())
results = []
for stdin, expected in job["cases"]:
    out = io.StringIO()
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(job["code"], "solution.py", "exec"), {"__name__": "__main__"})
        ok = True
    except SystemExit as e:
        ok = e.code in (None, 0)
    except BaseException:
        ok = False
    results.append((ok, out.getvalue()))
print(json.dumps(results))
'''


def _cases(gt: str) -> list[tuple[str, str]]:
    d = json.loads(gt)
    return list(zip(d["inputs"], d["outputs"]))


def per_completion(completions, tests) -> list[float]:
    def one(args) -> float:
        completion, gt = args
        code, cases = extract_code(completion_text(completion)), _cases(gt)
        if not code.strip():
            return 0.0
        p = subprocess.run([HOST_PYTHON, "-c", DRIVER], input=json.dumps({"code": code, "cases": cases}),
                           capture_output=True, text=True, timeout=60, cwd="/tmp")
        if p.returncode != 0:
            return 0.0
        got = json.loads(p.stdout.strip().splitlines()[-1])
        return 1.0 if all(ok and outputs_match(out, exp) for (ok, out), (_, exp) in zip(got, cases)) else 0.0

    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(one, zip(completions, tests)))


def per_case(completions, tests) -> list[float]:
    def one(args) -> float:
        completion, gt = args
        code = extract_code(completion_text(completion))
        if not code.strip():
            return 0.0
        for stdin, expected in _cases(gt):
            p = subprocess.run([HOST_PYTHON, "-c", code], input=stdin, capture_output=True, text=True, timeout=60,
                               cwd="/tmp")
            if p.returncode != 0 or not outputs_match(p.stdout, expected):
                return 0.0
        return 1.0

    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(one, zip(completions, tests)))


@pytest.fixture(scope="module")
def client():
    c = EmbeddedClient()
    yield c
    c.close()


def _drain(c: EmbeddedClient) -> None:
    c._reaper.submit(lambda: None).result()


def test_subprocess_per_completion(benchmark):
    assert per_completion(COMPLETIONS, TESTS) == WANT
    benchmark.pedantic(per_completion, args=(COMPLETIONS, TESTS), rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info["interpreter"] = HOST_PYTHON
    _runs[f"python3 per completion, {WORKERS} workers"] = list(benchmark.stats.stats.data)


def test_subprocess_per_case(benchmark):
    assert per_case(COMPLETIONS, TESTS) == WANT
    benchmark.pedantic(per_case, args=(COMPLETIONS, TESTS), rounds=ROUNDS, warmup_rounds=1)
    _runs[f"python3 per case, {WORKERS} workers"] = list(benchmark.stats.stats.data)


@pytest.mark.parametrize("workers, reset", [(None, True), (WORKERS, True), (None, False)],
                         ids=["default_workers", "same_workers", "no_reset_between_cases"])
def test_trl_reward_func_step(benchmark, client, workers, reset):
    fn = trl.reward_func(tests_column="tests", kind="io", client=client, max_workers=workers,
                         reset_between_cases=reset)

    def step():
        return fn(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[0]] * len(COMPLETIONS),
                  trainer_state=None, tests=TESTS)

    assert step() == WANT  # also prepares the template, before timing
    benchmark.pedantic(step, setup=lambda: _drain(client), rounds=ROUNDS, warmup_rounds=1)
    shown = WORKERS if workers is not None else f"default {(os.cpu_count() or 2) + 1}"
    _runs[f"collimate trl.reward_func, {shown} workers" + ("" if reset else ", no resets")] = \
        list(benchmark.stats.stats.data)


def _p99(data: list[float]) -> float:
    ordered = sorted(data)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def test_print_integrations_table(capsys):
    base = f"python3 per completion, {WORKERS} workers"
    if base not in _runs or len(_runs) < 2:
        pytest.skip("needs the benchmarks of this file in the same run")
    base_median = statistics.median(_runs[base])
    n = len(COMPLETIONS)
    lines = [
        "",
        f"a mixed GRPO step: 8 prompts x 8 completions, 3 stdin/stdout cases each ({os.cpu_count()} cores; "
        f"host interpreter {HOST_PYTHON})",
        f"{'grader':<58} {'rounds':>6} {'median':>11} {'p99':>11} {'per compl.':>10} {'ratio':>7}",
    ]
    for name, data in _runs.items():
        median = statistics.median(data)
        lines.append(f"{name:<58} {len(data):>6} {median * 1e3:8.1f} ms {_p99(data) * 1e3:8.1f} ms "
                     f"{median / n * 1e3:7.2f} ms {base_median / median:6.2f}x")
    lines.append("(ratio = the python3-per-completion median / this one's; >= 1.00x is at least as fast)")
    with capsys.disabled():
        print("\n".join(lines))
