"""`collimate bench`: the fork, exec, command and grading benchmarks, each next to its host baseline
measured in the same run, written as a PNG (latency distributions against the baselines) and a JSON
(every sample) in one directory, with a table on stdout. `--markdown` adds the figures as a markdown
table whose header names the date, the platform (the KVM module) and the machine; `--write-readme`
puts that block between README's figures markers and the run's JSON and PNG in docs/, so README never
holds a figure no run produced (tests/test_docs.py re-renders the block from docs/bench.json).

Families (rounds interleave each measured operation with its baseline, alternating which goes first,
so a busy spell of a shared machine lands on both):
- fork: `Sandbox("python")` enter + exit, and enter + exec(code="print(1)") + exit, against the
  host's os.fork() + _exit + waitpid of this process;
- fork group: `fork_group(N)` of a live sandbox + a map of exec(code="pass") in every child, against
  N host forks (each child exits at once; all are waited for);
- exec: exec(code="print(1)") in a warm sandbox against `/usr/bin/python3 -c "print(1)"`;
- command: exec(command=...) of `true` and `echo hi | wc -c` against `/bin/sh -c` of the same;
- grading: grade_batch of a GRPO group (N candidates of one UnitTestReward) against one host
  `/usr/bin/python3 -c candidate + tests` per candidate, 2 workers each.

A ratio is the series' median over its baseline's median: above 1, we are slower. Figures are
printed and plotted, never asserted; the outputs of the operations (stdout, rewards) are checked,
so a benchmark that stopped doing its work fails instead of getting fast. matplotlib is imported only
to draw (`pip install collimate-core[bench]`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

FAMILIES = ["fork", "fork group", "exec", "command", "grading"]
GAP = 0.003  # untimed, before each sample: a trainer works between rollouts; the pools refill
HOST_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else os.path.realpath(sys.executable)
SH = "/bin/sh"
WORKERS = 2

TESTS = """\
assert dedup_sorted([3, 1, 2, 3]) == [1, 2, 3]
assert dedup_sorted([]) == []
assert dedup_sorted([5, 5, 5]) == [5]
assert dedup_sorted([-1, 10, -1, 0]) == [-1, 0, 10]
"""
# Right and wrong solutions of one task; the candidates of a group cycle through them.
SOLUTIONS = [
    ("def dedup_sorted(xs):\n    return sorted(set(xs))\n", 1.0),
    ("def dedup_sorted(xs):\n    seen = []\n    for x in sorted(xs):\n        if x not in seen:\n            seen.append(x)\n    return seen\n", 1.0),
    ("def dedup_sorted(xs):\n    return sorted({x: 0 for x in xs})\n", 1.0),
    ("def dedup_sorted(xs):\n    return sorted(xs)\n", 0.0),  # keeps duplicates
    ("def dedup_sorted(xs):\n    return list(set(xs))[::-1]\n", 0.0),  # not sorted
    ("def dedup_sorted(xs):\n    return None\n", 0.0),
]


@dataclass
class Series:
    name: str
    family: str
    samples: list[float] = field(default_factory=list)  # milliseconds
    baseline: str | None = None  # the name of the baseline series; None: this is a baseline
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def p99(self) -> float:
        xs = sorted(self.samples)
        return xs[max(0, math.ceil(0.99 * len(xs)) - 1)]


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _timed(fn) -> float:
    time.sleep(GAP)
    t = time.perf_counter()
    fn()
    return _ms(t)


def _interleave(rounds: int, pairs: list[tuple[Series, object]], warmup: int = 1, client=None) -> None:
    """`rounds` rounds after `warmup` untimed ones; each times every (series, fn) once, in
    alternating order. With `client`, its teardowns of the previous call finish first, untimed."""
    for r in range(warmup + rounds):
        order = pairs if r % 2 == 0 else pairs[::-1]
        for series, fn in order:
            if client is not None:
                _drain(client)
            ms = _timed(fn)
            if r >= warmup:
                series.samples.append(ms)


def _drain(client) -> None:
    """Untimed: wait until the embedded client's reaper has torn down the last round's sandboxes."""
    reaper = getattr(client, "_reaper", None)
    if reaper is not None:
        reaper.submit(lambda: None).result()


def _host_fork() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _host_forks(n: int) -> None:
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


def _run(argv: list[str], expect: str) -> None:
    p = subprocess.run(argv, capture_output=True, text=True, cwd="/tmp")
    if p.returncode != 0 or p.stdout != expect:
        raise RuntimeError(f"{argv!r}: exit {p.returncode}, stdout {p.stdout!r} (expected {expect!r})")


def _check(r, expect: str, what: str) -> None:
    if r.exit_code != 0 or r.stdout != expect:
        raise RuntimeError(f"{what}: {r!r} (expected stdout {expect!r})")


def bench_fork(client, samples: int) -> list[Series]:
    from collimate_core import Sandbox

    base = Series("host os.fork()+_exit+waitpid", "fork")
    bare = Series('Sandbox("python") enter+exit', "fork", baseline=base.name)
    with_exec = Series('Sandbox enter+exec(code="print(1)")+exit', "fork", baseline=base.name)

    def enter_exit():
        with Sandbox("python", client=client):
            pass

    def enter_exec_exit():
        with Sandbox("python", client=client) as sb:
            _check(sb.exec(code="print(1)"), "1\n", "Sandbox exec")

    _interleave(samples, [(bare, enter_exit), (with_exec, enter_exec_exit), (base, _host_fork)], warmup=5)
    return [bare, with_exec, base]


def bench_fork_group(client, rounds: int, width: int) -> list[Series]:
    from collimate_core import Sandbox

    base = Series(f"{width} host os.fork()s, then waitpid", "fork group")
    group = Series(f"fork_group({width}) + map(exec(code=\"pass\"))", "fork group", baseline=base.name)
    with Sandbox("python", client=client) as parent:
        parent.exec(code="import json\nprefix = [i * i for i in range(10000)]")

        def one_group():
            with parent.fork_group(width) as grp:
                codes = grp.map(lambda i, child: child.exec(code="pass").exit_code)
            if codes != [0] * width:
                raise RuntimeError(f"fork group exit codes {codes}")

        _interleave(rounds, [(group, one_group), (base, lambda: _host_forks(width))], client=client)
    _drain(client)
    return [group, base]


def bench_exec(client, samples: int) -> list[Series]:
    from collimate_core import Sandbox

    base = Series(f'{HOST_PYTHON} -c "print(1)" (subprocess)', "exec")
    ours = Series('exec(code="print(1)") in a warm sandbox', "exec", baseline=base.name)
    with Sandbox("python", client=client) as sb:
        _interleave(samples, [
            (ours, lambda: _check(sb.exec(code="print(1)"), "1\n", "exec")),
            (base, lambda: _run([HOST_PYTHON, "-c", "print(1)"], "1\n")),
        ], warmup=3)
    return [ours, base]


def bench_command(client, samples: int) -> list[Series]:
    from collimate_core import Sandbox

    base_true = Series(f"{SH} -c true (subprocess)", "command")
    base_pipe = Series(f'{SH} -c "echo hi | wc -c" (subprocess)', "command")
    ours_true = Series('exec(command="true")', "command", baseline=base_true.name)
    ours_pipe = Series('exec(command="echo hi | wc -c")', "command", baseline=base_pipe.name)
    with Sandbox("python", client=client) as sb:
        _interleave(samples, [
            (ours_true, lambda: _check(sb.exec(command="true"), "", "exec(command='true')")),
            (base_true, lambda: _run([SH, "-c", "true"], "")),
            (ours_pipe, lambda: _check(sb.exec(command="echo hi | wc -c"), "3\n", "exec(command=pipe)")),
            (base_pipe, lambda: _run([SH, "-c", "echo hi | wc -c"], "3\n")),
        ], warmup=2)
    return [ours_true, base_true, ours_pipe, base_pipe]


def bench_grading(client, rounds: int, width: int) -> list[Series]:
    from collimate_core import UnitTestReward, grade_batch

    codes = [SOLUTIONS[i % len(SOLUTIONS)][0] + f"# candidate {i}\n" for i in range(width)]
    expected = [SOLUTIONS[i % len(SOLUTIONS)][1] for i in range(width)]
    spec = UnitTestReward(tests=TESTS, timeout_seconds=10)
    base = Series(f"{width} x {HOST_PYTHON} -c candidate+tests, {WORKERS} workers", "grading")
    ours = Series(f"grade_batch of {width} (one UnitTestReward), {WORKERS} workers", "grading", baseline=base.name)

    def batch():
        rewards = [g.reward for g in grade_batch(codes, spec, client=client, max_workers=WORKERS)]
        if rewards != expected:
            raise RuntimeError(f"grade_batch rewards {rewards}, expected {expected}")

    def plain():
        def one(code: str) -> float:
            p = subprocess.run([HOST_PYTHON, "-c", code + "\n" + TESTS], capture_output=True, timeout=60, cwd="/tmp")
            return 1.0 if p.returncode == 0 else 0.0

        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            rewards = list(pool.map(one, codes))
        if rewards != expected:
            raise RuntimeError(f"subprocess grader rewards {rewards}, expected {expected}")

    # The untimed first round prepares grade_batch's template.
    _interleave(rounds, [(ours, batch), (base, plain)], client=client)
    _drain(client)
    return [ours, base]


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or None


def _machine() -> dict:
    info = {"cores": os.cpu_count(), "cpu": _cpu_model(), "python": platform.python_version(),
            "host_python": HOST_PYTHON, "kernel": platform.release(), "kvm_module": None}
    info["kvm_module"] = next((m for m in ("kvm_pvm", "kvm_intel", "kvm_amd")
                               if os.path.isdir(f"/sys/module/{m}")), None)
    return info


_NO_MATPLOTLIB = ("collimate bench draws its figure with matplotlib, which is not installed here: "
                  "pip install collimate-core[bench]")


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(_NO_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt(ms: float) -> str:
    if ms >= 1000:
        return f"{ms / 1e3:.2f} s"
    return f"{ms * 1e3:.0f} us" if ms < 1 else f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


def plot(series: list[Series], meta: dict, path: str) -> None:
    plt = _require_matplotlib()
    families = [f for f in FAMILIES if any(s.family == f for s in series)]
    heights = [len([s for s in series if s.family == f]) + 0.9 for f in families]
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(len(families), 1, figsize=(10, 0.5 * sum(heights) + 1.4),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    ticks = FuncFormatter(lambda v, _: f"{v:g}")
    ours_c, base_c = "#1f77b4", "#e8820c"
    for ax, fam in zip(axes[:, 0], families):
        rows = [s for s in series if s.family == fam][::-1]  # top to bottom as measured
        colours = [base_c if s.baseline is None else ours_c for s in rows]
        bp = ax.boxplot([s.samples for s in rows], vert=False, whis=(1, 99), widths=0.6, patch_artist=True,
                        flierprops={"marker": ".", "markersize": 2, "alpha": 0.5},
                        medianprops={"color": "black"})
        for patch, c in zip(bp["boxes"], colours):
            patch.set_facecolor(c)
            patch.set_alpha(0.75)
        ax.set_xscale("log")
        ax.set_yticks(range(1, len(rows) + 1), [s.name for s in rows], fontsize=8)
        for t, c in zip(ax.get_yticklabels(), colours):
            t.set_color(c if c == base_c else "black")
        by_name = {s.name: s for s in series}
        lo = min(min(s.samples) for s in rows)
        hi = max(max(s.samples) for s in rows)
        ax.set_xlim(lo / 1.3, hi * 1.3)
        ax.xaxis.set_major_formatter(ticks)
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "25" else ""))
        for y, s in enumerate(rows, start=1):
            text = f"p50 {_fmt(s.median)}   p99 {_fmt(s.p99)}"
            if s.baseline is not None:
                ratio = s.median / by_name[s.baseline].median
                text += f"\n{ratio:.2f}x its baseline" + ("  (slower)" if ratio > 1 else "")
            ax.text(1.01, y, text, transform=ax.get_yaxis_transform(), va="center", fontsize=7.5,
                    color="#b00000" if s.baseline and s.median > by_name[s.baseline].median else "black")
        ax.set_title(fam, loc="left", fontsize=9, fontweight="bold")
        ax.grid(axis="x", which="both", alpha=0.25)
        ax.tick_params(axis="x", which="both", labelsize=7)
    axes[-1, 0].set_xlabel("milliseconds (log); box: quartiles, whiskers: p1-p99; "
                           "orange: host baseline, blue: collimate; ratio = median / baseline median",
                           fontsize=7.5)
    m = meta["machine"]
    fig.suptitle(f"collimate bench, {meta['date']}: {m['cores']} cores, KVM {m['kvm_module'] or '?'}, "
                 f"load average {meta['load_before'][0]:.1f} -> {meta['load_after'][0]:.1f}; "
                 f"n = {meta['samples']} per operation, {meta['group_rounds']} per group", fontsize=9)
    fig.subplots_adjust(left=0.31, right=0.8, top=1 - 0.7 / fig.get_figheight(), bottom=0.55 / fig.get_figheight(),
                        hspace=0.55)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(output: str, samples: int, width: int, quick: bool) -> dict:
    from collimate_core import Sandbox, connect

    import importlib.util

    # Checked before a minute of measuring, imported only to draw: loaded into this process, it
    # would make the host-fork baselines slower (a larger address space to copy).
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit(_NO_MATPLOTLIB)
    if not os.path.exists(SH):
        raise SystemExit(f"collimate bench needs {SH} for its baselines")
    rounds = max(3, samples // 15)  # fork groups and grading batches: fewer, longer samples
    os.makedirs(output, exist_ok=True)
    client = connect()
    t0 = time.perf_counter()
    if hasattr(client, "_template"):
        client._template("python")  # bake (first run) or load the template, start its zygote
    with Sandbox("python", client=client) as sb:
        sb.exec(code="print(1)")
    print(f"python template ready in {time.perf_counter() - t0:.2f} s; "
          f"{samples} samples per operation, {rounds} per group, width {width}")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": _machine(),
            "load_before": list(os.getloadavg()), "samples": samples, "group_rounds": rounds,
            "width": width, "quick": quick, "gap_ms": GAP * 1e3}
    series: list[Series] = []
    for fam, fn in [("fork", lambda: bench_fork(client, samples)),
                    ("fork group", lambda: bench_fork_group(client, rounds, width)),
                    ("exec", lambda: bench_exec(client, samples)),
                    ("command", lambda: bench_command(client, samples)),
                    ("grading", lambda: bench_grading(client, rounds, width))]:
        t = time.perf_counter()
        series += fn()
        print(f"  {fam}: {time.perf_counter() - t:.1f} s", flush=True)
    meta["load_after"] = list(os.getloadavg())
    by_name = {s.name: s for s in series}
    doc = {"meta": meta, "unit_note": "every sample is one timed operation, in milliseconds",
           "p99_note": "nearest rank: with fewer than 100 samples, the largest",
           "ratio_note": "median / the baseline's median; above 1: slower than the baseline", "series": []}
    for s in series:
        ratio = s.median / by_name[s.baseline].median if s.baseline else None
        doc["series"].append({"name": s.name, "family": s.family, "unit": "ms", "n": len(s.samples),
                              "median": s.median, "p99": s.p99, "baseline": s.baseline, "ratio": ratio,
                              "samples": s.samples})
    png, js = os.path.join(output, "bench.png"), os.path.join(output, "bench.json")
    with open(js, "w") as f:
        json.dump(doc, f, indent=1)
    plot(series, meta, png)
    _table(doc)
    print(f"wrote {png} and {js}")
    client.close()
    return doc


def _table(doc: dict) -> None:
    print(f"\n{'family':<11} {'series':<58} {'n':>4} {'median':>10} {'p99':>10} {'ratio':>7}")
    for s in doc["series"]:
        ratio = f"{s['ratio']:6.2f}x" if s["ratio"] is not None else "  (base)"
        print(f"{s['family']:<11} {s['name'][:58]:<58} {s['n']:>4} {_fmt(s['median']):>10} {_fmt(s['p99']):>10} {ratio:>7}")
    print("ratio = median / its baseline's median (above 1: slower than the baseline)")
    losses = [s for s in doc["series"] if s["ratio"] is not None and s["ratio"] > 1]
    if losses:
        print("\nwhere we lose (slower than the baseline in this run):")
        for s in losses:
            print(f"  {s['family']}: {s['name']} is {s['ratio']:.2f}x {s['baseline']} "
                  f"(median {_fmt(s['median'])})")
    else:
        print("\nwe lose nowhere in this run: every series is at least as fast as its baseline")
    wins = [s for s in doc["series"] if s["ratio"] is not None and s["ratio"] <= 1]
    if wins:
        print("where we are at least as fast as the baseline:")
    for s in wins:
        print(f"  {s['family']}: {s['name']} at {s['ratio']:.2f}x {s['baseline']}")


FIGURES_BEGIN = "<!-- figures:begin: written by `collimate bench --write-readme` from docs/bench.json; do not edit -->"
FIGURES_END = "<!-- figures:end -->"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(doc: dict) -> str:
    """The figures block of one run: a header naming the date, the platform and the machine, then one
    line per measured series against its baseline of the same run. A pure function of bench.json, so
    README's block can be checked against the run that produced it."""
    meta, m = doc["meta"], doc["meta"]["machine"]
    by_name = {s["name"]: s for s in doc["series"]}
    platform_name = m.get("kvm_module") or "no KVM module found"
    load = f"load average {meta['load_before'][0]:.1f} -> {meta['load_after'][0]:.1f}"
    lines = [
        f"Measured {meta['date']} by `collimate bench` on platform {platform_name}: "
        f"{m['cores']} cores, {m.get('cpu') or 'CPU model unknown'}, Linux {m['kernel']}; {load}"
        f"{' (a shared, busy machine)' if meta['load_before'][0] > m['cores'] else ''}; "
        f"n = {meta['samples']} per operation, {meta['group_rounds']} per group of {meta['width']}.",
        "",
        "| operation | ours: median (p99) | baseline, same run: median (p99) | ratio |",
        "|---|---|---|---|",
    ]
    for s in doc["series"]:
        if s["baseline"] is None:
            continue
        b = by_name[s["baseline"]]
        lines.append(f"| {_md_cell(s['name'])} | {_fmt(s['median'])} ({_fmt(s['p99'])}) | "
                     f"{_md_cell(b['name'])}: {_fmt(b['median'])} ({_fmt(b['p99'])}) | {s['ratio']:.2f}x |")
    lines += ["", "ratio = our median / the baseline's median: above 1, we are slower. "
              "Every sample: [docs/bench.json](docs/bench.json); the distributions: [docs/bench.png](docs/bench.png)."]
    return "\n".join(lines) + "\n"


def readme_block(text: str, path: str = "README.md") -> str:
    """The figures block between README's markers (without them)."""
    try:
        start = text.index(FIGURES_BEGIN) + len(FIGURES_BEGIN)
        end = text.index(FIGURES_END, start)
    except ValueError:
        raise SystemExit(f"{path} has no figures block: put the two lines\n{FIGURES_BEGIN}\n{FIGURES_END}\n"
                         "where the figures go, then run `collimate bench --write-readme` again") from None
    return text[start:end].strip("\n") + "\n"


def write_readme(readme: str, block: str, doc: dict, png: str | None) -> None:
    """Replace README's figures block, and put the run's JSON (and PNG) beside it in docs/, so the
    block, bench.json and bench.png always come from the same run."""
    with open(readme) as f:
        text = f.read()
    readme_block(text, readme)  # the markers are there
    start = text.index(FIGURES_BEGIN) + len(FIGURES_BEGIN)
    end = text.index(FIGURES_END, start)
    text = text[:start] + "\n" + block + text[end:]
    docs = os.path.join(os.path.dirname(os.path.abspath(readme)), "docs")
    os.makedirs(docs, exist_ok=True)
    with open(os.path.join(docs, "bench.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    if png is not None and os.path.abspath(png) != os.path.join(docs, "bench.png"):
        shutil.copyfile(png, os.path.join(docs, "bench.png"))
    with open(readme, "w") as f:
        f.write(text)
    print(f"wrote the figures block into {readme}, and docs/bench.json" + (" and docs/bench.png" if png else ""))


def add_subcommand(sub) -> None:
    b = sub.add_parser("bench", help="fork, exec, command and grading benchmarks against host baselines: PNG + JSON")
    b.add_argument("--output", default="collimate-bench", help="directory for bench.png and bench.json")
    b.add_argument("--quick", action="store_true", help="few samples (tests, CI)")
    b.add_argument("--samples", type=int, default=None, help="samples per fast operation (default 200; --quick 12)")
    b.add_argument("--width", type=int, default=64, help="fork group and GRPO group width")
    b.add_argument("--markdown", action="store_true",
                   help="also print the figures as a markdown table and write figures.md beside the PNG")
    b.add_argument("--write-readme", nargs="?", const="README.md", default=None, metavar="README",
                   help="(implies --markdown) put the figures block between README's figures markers and this "
                        "run's bench.json and bench.png in its docs/ (default README.md)")
    b.add_argument("--from-json", default=None, metavar="BENCH_JSON",
                   help="measure nothing: render the markdown (and README's block) from an earlier run's bench.json")


def run_cli(args) -> None:
    samples = args.samples if args.samples is not None else (12 if args.quick else 200)
    if samples < 1 or args.width < 1:
        raise SystemExit("--samples and --width must be at least 1")
    if args.write_readme is not None and not os.path.isfile(args.write_readme):
        raise SystemExit(f"--write-readme {args.write_readme}: no such file (run from the checkout, or name the README)")
    if args.write_readme is not None:
        with open(args.write_readme) as f:
            readme_block(f.read(), args.write_readme)  # fail before a minute of measuring, not after
    if args.from_json is not None:
        with open(args.from_json) as f:
            doc = json.load(f)
        png = os.path.join(os.path.dirname(args.from_json), "bench.png")
        png = png if os.path.exists(png) else None
    else:
        doc = run(args.output, samples, args.width, args.quick)
        png = os.path.join(args.output, "bench.png")
    if args.markdown or args.write_readme is not None:
        block = markdown(doc)
        if args.from_json is None:
            with open(os.path.join(args.output, "figures.md"), "w") as f:
                f.write(block)
        print("\n" + block, end="")
        if args.write_readme is not None:
            write_readme(args.write_readme, block, doc, png)
