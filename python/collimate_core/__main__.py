"""`collimate` (= `python -m collimate_core`): `demo`, the main job end to end on this host; `serve`
and `keys`, the control-plane worker and its API keys (server/cli.py); `bench`, the benchmarks against
their host baselines as a PNG, a JSON and
(`--markdown`, `--write-readme`) README's figures table (bench.py).

`demo` bakes the python template (Debian's CPython with the in-guest agent, checkpointed at its ready
point; cached after the first run), forks sandboxes from it and measures the fork latency, then
grades a GRPO group of 64 candidate completions in forked children of one parent, and prints the
figures next to a host baseline (os.fork + _exit + waitpid of this process) from the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round((len(xs) - 1) * p))]


def _host_fork_ms() -> float:
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return (time.perf_counter() - t) * 1e3


CANDIDATES = [
    "```python\ndef solve(xs):\n    return sorted(xs)\n```",
    "```python\ndef solve(xs):\n    out = list(xs)\n    out.sort()\n    return out\n```",
    "```python\ndef solve(xs):\n    return sorted(set(xs))\n```",  # drops duplicates
    "```python\ndef solve(xs):\n    return xs\n```",  # does nothing
]
TESTS = "assert solve([3, 1, 2]) == [1, 2, 3]\nassert solve([2, 2, 1]) == [1, 2, 2]\nassert solve([]) == []\n"


def demo(width: int, samples: int) -> None:
    from collimate_core import Sandbox, UnitTestReward, connect, extract_code, grade_batch

    client = connect()
    t0 = time.perf_counter()
    client._template("python")  # bake (first run) or load the template, start its zygote
    print(f"python template ready in {time.perf_counter() - t0:.2f} s")

    enter_exit, enter_exec_exit = [], []
    for i in range(samples):
        time.sleep(0.003)  # a trainer works between rollouts; the zygote refills its spare clones
        t = time.perf_counter()
        with Sandbox("python", client=client) as sb:
            if i % 2:
                r = sb.exec(code="print(1)")
                assert r.ok and r.stdout == "1\n", r
        (enter_exec_exit if i % 2 else enter_exit).append((time.perf_counter() - t) * 1e3)
    baseline = [_host_fork_ms() for _ in range(samples)]

    # Shell commands: each starts guest processes (a fork of the interpreter, then /bin/sh), far
    # slower than code in the persistent interpreter; beside the native /bin/sh -c true.
    import subprocess

    commands, native = [], []
    with Sandbox("python", client=client) as sb:
        for _ in range(max(5, samples // 10)):
            t = time.perf_counter()
            r = sb.exec(command="true")
            commands.append((time.perf_counter() - t) * 1e3)
            assert r.ok, r
            t = time.perf_counter()
            subprocess.run(["/bin/sh", "-c", "true"], check=True)
            native.append((time.perf_counter() - t) * 1e3)

    completions = [CANDIDATES[i % len(CANDIDATES)] for i in range(width)]
    codes = [extract_code(c) for c in completions]
    t = time.perf_counter()
    results = grade_batch(codes, UnitTestReward(tests=TESTS), client=client)
    group_ms = (time.perf_counter() - t) * 1e3
    rewards = [r.reward for r in results]
    expected = [1.0 if i % len(CANDIDATES) < 2 else 0.0 for i in range(width)]
    print(f"graded a GRPO group of {width}: mean reward {sum(rewards) / width:.2f} "
          f"({'as expected' if rewards == expected else 'UNEXPECTED: ' + str(rewards)}), "
          f"seed-ack {results[0].seed_ack}")

    b50 = statistics.median(baseline)
    rows = [
        ("host os.fork()+_exit+waitpid", baseline),
        ("Sandbox enter+exit (warm or new clone)", enter_exit),
        ("Sandbox enter+exec(print(1))+exit", enter_exec_exit),
        ("exec(command='true') in a sandbox", commands),
        ("native /bin/sh -c true (subprocess)", native),
    ]
    print(f"{'':38} {'median':>9} {'p99':>9} {'x host fork':>12}")
    for name, xs in rows:
        m = statistics.median(xs)
        print(f"{name:38} {m:7.2f}ms {_pct(xs, 0.99):7.2f}ms {m / b50:12.2f}")
    label = f"grade_batch of {width} candidates"
    print(f"{label:38} {group_ms:7.1f}ms {'':>9} {group_ms / b50:12.2f}")
    client.close()
    if rewards != expected:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="collimate")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="bake the python template, fork a group, grade it, print fork latency")
    d.add_argument("--width", type=int, default=64)
    d.add_argument("--samples", type=int, default=200)
    from collimate_core import bench

    bench.add_subcommand(sub)  # bench
    from collimate_core.server.cli import add_subcommands, run

    add_subcommands(sub)  # serve, keys, openapi
    from collimate_core.ray import client as _ray

    _ray.add_subcommand(sub)  # ray-host
    from collimate_core import doctor

    doctor.add_subcommand(sub)  # doctor
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        demo(args.width, args.samples)
    elif args.cmd == "bench":
        bench.run_cli(args)
    elif args.cmd == "ray-host":
        _ray.run_cli(args)
    elif args.cmd == "doctor":
        doctor.run_cli(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
