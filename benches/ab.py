"""README's figures, this build against an earlier revision's, measured alternately.

    python3 benches/ab.py BASE_REV [--rounds 3] [--samples 40] [--width 64] [--workdir DIR]

Builds the extension of BASE_REV (its tree from `git archive`, a copy of this checkout's target
directory so that only the changed crates compile, `maturin build --release`, the wheel's `_core`
put beside that tree's python package), copies this checkout's package as built now (so that a
rebuild meanwhile changes nothing), then runs `collimate bench` (the command that writes
README's figures table: fork, fork group, exec, command and grading, each beside its host
baseline) with each build in turn, `--rounds` times each, alternating which goes first, each
build with its own cache (its own root filesystem, templates and zygotes: the formats may
differ between revisions; downloaded Debian packages are shared).

For every figure it prints, per build, the median of the round medians and of the round p99s,
the ratio this/base of those medians, and the noise: the spread (max - min) of the round medians
of one build over their median, the larger of the two builds'. A ratio further from 1 than that
noise is a change; inside it, the builds are not told apart on this machine at this load. The
host baselines (same run, same rounds) are in the table too: their ratio is pure noise, a
second estimate of it. Every figure names the platform (the KVM module) and the load.

Nothing is asserted: figures go in docs/performance.md. The work directory (default: a temporary
one) is removed unless --workdir names one, which is then reused (an existing build is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def sh(cmd: list[str], **kw) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise SystemExit(f"ab: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-4000:]}")
    return p.stdout


def target_dir() -> Path:
    meta = json.loads(sh(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=REPO))
    return Path(meta["target_directory"])


def build(rev: str, work: Path) -> Path:
    """The tree of `rev` with its extension built in place; returns its python directory."""
    commit = sh(["git", "rev-parse", "--verify", rev + "^{commit}"], cwd=REPO).strip()
    src = work / f"src-{commit[:12]}"
    so = src / "python" / "collimate_core" / "_core.abi3.so"
    if so.exists():
        return src / "python"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", commit], cwd=REPO, stdout=subprocess.PIPE)
    # -m: the files dated now, not at the commit: cargo compares source mtimes with the copied
    # target directory's artifacts, and with the commit's dates it kept this checkout's build
    # (the "base" extension was byte for byte this one's).
    subprocess.run(["tar", "-x", "-m", "-C", str(src)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"ab: git archive {commit} failed")
    tgt = work / "target"
    if not tgt.exists():
        print(f"ab: copying {target_dir()} (the dependencies, already built) to {tgt}", flush=True)
        shutil.copytree(target_dir(), tgt, symlinks=True, ignore=shutil.ignore_patterns("wheels", "tmp"))
    print(f"ab: building {rev} ({commit[:12]}) in {src}", flush=True)
    t = time.monotonic()
    wheels = work / f"wheels-{commit[:12]}"
    shutil.rmtree(wheels, ignore_errors=True)
    sh(["maturin", "build", "--release", "--quiet", "-i", sys.executable, "-o", str(wheels)],
       cwd=src, env=dict(os.environ, CARGO_TARGET_DIR=str(tgt)))
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        so.write_bytes(z.read("collimate_core/_core.abi3.so"))
    so.chmod(0o755)
    print(f"ab: built {rev} in {time.monotonic() - t:.0f} s", flush=True)
    return src / "python"


def bench(python_dir: Path, cache: Path, out: Path, samples: int, width: int, quick: bool = False) -> dict:
    mine = os.environ.get("COLLIMATE_CACHE")
    if mine and not (cache / "rootfs").exists() and (Path(mine) / "rootfs").is_dir():
        # The root filesystems built here already (one directory per recipe: a revision whose
        # recipe differs builds its own beside them).
        shutil.copytree(Path(mine) / "rootfs", cache / "rootfs", symlinks=True)
    env = dict(os.environ, PYTHONPATH=str(python_dir), COLLIMATE_CACHE=str(cache))
    env.pop("COLLIMATE_ROOTFS", None)
    env.setdefault("COLLIMATE_DEB_CACHE", str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "collimate" / "debs"))
    cmd = [sys.executable, "-m", "collimate_core", "bench", "--output", str(out), "--width", str(width)]
    cmd += ["--quick"] if quick else ["--samples", str(samples)]
    p = subprocess.run(cmd, env=env, cwd="/tmp", capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"ab: collimate bench with {python_dir} failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-4000:]}")
    return json.loads((out / "bench.json").read_text())


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else float("nan")


def fmt(ms: float) -> str:
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    if ms >= 1:
        return f"{ms:.3g} ms"
    return f"{ms * 1000:.0f} us"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the revision to compare with (a commit, a branch)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of collimate bench per build")
    ap.add_argument("--samples", type=int, default=40, help="samples per fast operation in each run")
    ap.add_argument("--width", type=int, default=64, help="fork group and GRPO group width")
    ap.add_argument("--workdir", help="keep the builds, caches and bench.json files here")
    ap.add_argument("--report-only", action="store_true", help="measure nothing: the table from --workdir's rounds")
    args = ap.parse_args()
    if args.report_only:
        if not args.workdir:
            raise SystemExit("ab: --report-only reads the rounds of --workdir DIR")
        work = Path(args.workdir)
        runs = {b: [json.loads((work / f"round{r}-{b}" / "bench.json").read_text()) for r in range(args.rounds)] for b in ("this", "base")}
        base_commit = sh(["git", "rev-parse", "--short=12", args.base + "^{commit}"], cwd=REPO).strip()
        report(runs, {"this": (None, "(as measured)"), "base": (None, base_commit)}, args)
        return

    work = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="collimate-ab."))
    work.mkdir(parents=True, exist_ok=True)
    try:
        base_commit = sh(["git", "rev-parse", "--short=12", args.base + "^{commit}"], cwd=REPO).strip()
        head = sh(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO).strip()
        dirty = " + uncommitted changes" if sh(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO).strip() else ""
        if not (REPO / "python" / "collimate_core" / "_core.abi3.so").exists():
            raise SystemExit("ab: this checkout's extension is not built (pip install -e .)")
        # A copy of this checkout's package as built now: a rebuild while the rounds run changes nothing.
        this = work / "this" / "python"
        shutil.rmtree(this.parent, ignore_errors=True)
        shutil.copytree(REPO / "python", this, ignore=shutil.ignore_patterns("__pycache__"))
        builds = {"this": (this, f"{head}{dirty}"), "base": (build(args.base, work), base_commit)}
        runs: dict[str, list[dict]] = {"this": [], "base": []}
        for name, (py, _) in builds.items():  # untimed: bake the template, build the root filesystem
            print(f"ab: warming up {name} (root filesystem, python template)", flush=True)
            bench(py, work / f"cache-{name}", work / f"warm-{name}", args.samples, args.width, quick=True)
        for r in range(args.rounds):
            order = ["this", "base"] if r % 2 == 0 else ["base", "this"]
            for name in order:
                t = time.monotonic()
                doc = bench(builds[name][0], work / f"cache-{name}", work / f"round{r}-{name}", args.samples, args.width)
                runs[name].append(doc)
                print(f"ab: round {r + 1}/{args.rounds} {name}: {time.monotonic() - t:.0f} s, "
                      f"load {doc['meta']['load_before'][0]:.1f} -> {doc['meta']['load_after'][0]:.1f}", flush=True)
        report(runs, builds, args)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


def report(runs: dict[str, list[dict]], builds: dict, args) -> None:
    meta = runs["this"][0]["meta"]
    m = meta["machine"]
    loads = [d["meta"][k][0] for ds in runs.values() for d in ds for k in ("load_before", "load_after")]
    print(f"\nthis = {builds['this'][1]}, base = {builds['base'][1]}; platform {m['kvm_module']}: {m['cores']} cores, "
          f"{m['cpu']}, Linux {m['kernel']}; load average {min(loads):.1f}-{max(loads):.1f}; "
          f"{args.rounds} alternating rounds of `collimate bench --samples {args.samples} --width {args.width}` per build")
    print("median / p99: the median over rounds of each round's median / p99 (min-max of the round medians in brackets);")
    print("noise: the larger spread (max-min over median) of one build's round medians; ratio: this / base of the medians;")
    print("vs baseline: each round's median over its host baseline's in the same run (the load of that moment divides out),")
    print("median over rounds, this / base\n")
    print("| figure | this: median [range] | this: p99 | base: median [range] | base: p99 | ratio | noise | verdict | vs baseline: this, base (ratio) |")
    print("|---|---|---|---|---|---|---|---|---|")
    names = [s["name"] for s in runs["this"][0]["series"]]
    for name in names:
        per, rel = {}, {}
        for b in ("this", "base"):
            ss = [next(s for s in d["series"] if s["name"] == name) for d in runs[b]]
            per[b] = ([s["median"] for s in ss], [s["p99"] for s in ss])
            rel[b] = statistics.median([s["ratio"] for s in ss]) if all(s.get("ratio") for s in ss) else None
        med = {b: statistics.median(per[b][0]) for b in per}
        p99 = {b: statistics.median(per[b][1]) for b in per}
        ratio = med["this"] / med["base"]
        noise = max(spread(per["this"][0]), spread(per["base"][0]))
        verdict = "within noise" if abs(ratio - 1) <= noise else ("slower" if ratio > 1 else "faster")
        is_base = not any(s["name"] == name and s.get("baseline") for s in runs["this"][0]["series"])
        label = f"{name}{' (host baseline)' if is_base else ''}".replace("|", "\\|")
        cells = [f"{fmt(med[b])} [{fmt(min(per[b][0]))}-{fmt(max(per[b][0]))}] | {fmt(p99[b])}" for b in ("this", "base")]
        vs = f"{rel['this']:.2f}x, {rel['base']:.2f}x ({rel['this'] / rel['base']:.2f})" if rel["this"] and rel["base"] else "-"
        print(f"| {label} | {cells[0]} | {cells[1]} | {ratio:.2f}x | {noise * 100:.0f}% | {verdict} | {vs} |")


if __name__ == "__main__":
    main()
