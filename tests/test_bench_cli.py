"""`collimate bench --quick` end to end, as a user runs it: a subprocess of this interpreter with the
current environment (COLLIMATE_CACHE as given). It checks what the command writes, never the figures
themselves: the PNG is a real image matplotlib reads back, and the JSON has every family, each with
a measured series and its named baseline, positive medians and ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import collimate_core
from collimate_core import bench

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

FAMILIES = {"fork", "fork group", "exec", "command", "grading"}


def test_bench_quick_writes_png_and_json(tmp_path):
    import matplotlib.image  # the bench extra; scripts/setup.sh installs it

    out = tmp_path / "bench"
    readme = tmp_path / "README.md"  # a checkout's README with its figures markers
    readme.write_text(f"# title\n\n{bench.FIGURES_BEGIN}\nold figures\n{bench.FIGURES_END}\n\n## after\n")
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(collimate_core.__file__))  # the package under test
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    p = subprocess.run([sys.executable, "-m", "collimate_core", "bench", "--quick", "--output", str(out),
                        "--write-readme", str(readme)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr

    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(png) > 20_000  # five panels of boxes and text, not an empty canvas
    img = matplotlib.image.imread(str(out / "bench.png"))
    assert img.ndim == 3 and img.shape[2] in (3, 4) and img.shape[0] > 400 and img.shape[1] > 400, img.shape
    assert img[..., :3].std() > 0.05  # drawn on, not blank

    doc = json.loads((out / "bench.json").read_text())
    series = doc["series"]
    by_name = {s["name"]: s for s in series}
    assert {s["family"] for s in series} == FAMILIES
    for s in series:
        assert s["unit"] == "ms" and s["n"] == len(s["samples"]) > 0, s["name"]
        assert s["median"] > 0 and s["p99"] >= s["median"], s["name"]
    for fam in FAMILIES:
        measured = [s for s in series if s["family"] == fam and s["baseline"] is not None]
        baselines = [s for s in series if s["family"] == fam and s["baseline"] is None]
        assert measured and baselines, fam
        for s in measured:
            base = by_name.get(s["baseline"])
            assert base is not None and base["family"] == fam and base["baseline"] is None, s
            assert s["ratio"] > 0
            assert s["ratio"] == pytest.approx(s["median"] / base["median"])
    # Baselines that do the job without a sandbox, named by what they run (absolute paths).
    names = " ".join(s["name"] for s in series if s["baseline"] is None)
    assert "os.fork()" in names and "/bin/sh -c" in names and "python" in names

    # The table on stdout: a row per series and a plain statement of where we lose (or that we do not).
    for s in series:
        assert s["name"][:58] in p.stdout, s["name"]
    assert "where we lose" in p.stdout or "we lose nowhere" in p.stdout

    # The markdown block: printed, written beside the PNG, put between README's markers (the rest of
    # README untouched), this run's JSON and PNG beside it in docs/; a pure rendering of the JSON.
    block = (out / "figures.md").read_text()
    assert block == bench.markdown(doc) and block in p.stdout
    text = readme.read_text()
    assert text == f"# title\n\n{bench.FIGURES_BEGIN}\n{block}{bench.FIGURES_END}\n\n## after\n"
    assert json.loads((tmp_path / "docs" / "bench.json").read_text()) == doc
    assert (tmp_path / "docs" / "bench.png").read_bytes() == png
    measured = [s for s in series if s["baseline"] is not None]
    rows = [line for line in block.splitlines() if line.startswith("| ") and "x |" in line]
    assert len(rows) == len(measured)
    assert "platform kvm_" in block.splitlines()[0] and "cores" in block.splitlines()[0]
