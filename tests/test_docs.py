"""The documentation as a user meets it: README's quickstart snippets and every python block in docs/
run as written on the embedded engine (the blocks of one page in order, in one namespace, as a reader
would paste them), and README's figures block is exactly what `collimate bench --markdown` renders
from the run kept in docs/bench.json.

A block that cannot run on its own (it needs an OCI image, a Ray cluster, a model, a server) says so
with `<!-- not-run: reason -->` on the line before its fence; such blocks are still compiled, and
counted, so the marker cannot hide a broken snippet's syntax or spread unnoticed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from collimate_core import bench

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))
NOT_RUN = re.compile(r"^<!-- not-run: (\S.*?) -->$")
OPEN = re.compile(r"^(`{3,}|~{3,})python\s*$")
HEADER = re.compile(
    r"^Measured \d{4}-\d\d-\d\d \d\d:\d\d UTC by `collimate bench` on platform (kvm_pvm|kvm_intel|kvm_amd): "
    r"\d+ cores, [^;]+, Linux \S+; load average \d+\.\d -> \d+\.\d( \(a shared, busy machine\))?; "
    r"n = \d+ per operation, \d+ per group of \d+\.$")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # the reason, for a block marked not-run


def python_blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(1), i
        close = re.compile(rf"^{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        i += 1
        while i < len(lines) and not close.match(lines[i]):
            i += 1
        assert i < len(lines), f"{page.name}:{start + 1}: a python block that never closes"
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(prev.strip())
        blocks.append(Block(page, start + 1, "\n".join(lines[start + 1:i]) + "\n", marker.group(1) if marker else None))
        i += 1
    return blocks


def test_every_python_block_compiles_and_every_not_run_marker_names_a_reason():
    runnable, not_run = [], []
    for page in PAGES:
        text = page.read_text()
        markers = [ln for ln in text.split("\n") if "not-run" in ln]
        blocks = python_blocks(page)
        marked = [b for b in blocks if b.not_run is not None]
        # Every marker is a well-formed one that stands before a python block (none left stray).
        assert len(markers) == len(marked), f"{page.name}: a not-run marker without a python block after it: {markers}"
        for b in blocks:
            compile(b.code, f"{b.page.name}:{b.line}", "exec")  # a syntax error fails, marked or not
            (not_run if b.not_run else runnable).append(b)
    readme_runnable = [b for b in runnable if b.page == README]
    assert len(readme_runnable) >= 4, "README's quickstart lost its snippets"
    assert all(b.not_run is None for b in python_blocks(README)), "README's snippets must all run"
    print(f"\n{len(runnable)} python blocks run, {len(not_run)} marked not-run:")
    for b in not_run:
        print(f"  {b.page.relative_to(ROOT)}:{b.line}: {b.not_run}")


RUNNABLE_PAGES = [p for p in PAGES if any(b.not_run is None for b in python_blocks(p))]


@pytest.mark.kvm
@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE_PAGES])
def test_python_blocks_run_as_written(page, monkeypatch):
    # connect() as on a fresh host: no key, no Ray address, so the embedded engine answers.
    for var in ("COLLIMATE_API_KEY", "COLLIMATE_RAY_ADDRESS", "COLLIMATE_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    ns: dict = {"__name__": "__docs__"}
    try:
        for b in python_blocks(page):
            if b.not_run is None:
                code = compile(b.code, f"{page.relative_to(ROOT)}:{b.line}", "exec")
                exec(code, ns)  # an assertion in the snippet, or any exception, fails here with its line
    finally:
        for v in list(ns.values()):
            if type(v).__name__.endswith("Client") and hasattr(v, "close"):
                v.close()


def test_readme_figures_block_is_the_rendering_of_one_run():
    block = bench.readme_block(README.read_text())
    doc = json.loads((ROOT / "docs" / "bench.json").read_text())
    assert block == bench.markdown(doc), "README's figures were edited by hand: run `collimate bench --write-readme`"
    assert not doc["meta"]["quick"], "README's figures come from a full run, not --quick"
    lines = block.split("\n")
    assert HEADER.match(lines[0]), lines[0]
    measured = [s for s in doc["series"] if s["baseline"] is not None]
    rows = [ln for ln in lines if ln.startswith("| ") and ln.endswith("x |")]
    assert len(rows) == len(measured) >= 5
    for s, row in zip(measured, rows):
        assert row.endswith(f" {s['median'] / next(b for b in doc['series'] if b['name'] == s['baseline'])['median']:.2f}x |")
    assert (ROOT / "docs" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _collimate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(bench.__file__))  # the package under test
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-m", "collimate_core", "bench", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_bench_markdown_prints_readmes_block_and_writes_it(tmp_path):
    block = bench.readme_block(README.read_text())
    p = _collimate("--markdown", "--from-json", str(ROOT / "docs" / "bench.json"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "\n" + block  # exactly what README holds

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.FIGURES_BEGIN}\nstale\n{bench.FIGURES_END}\nrest\n")
    p = _collimate("--from-json", str(ROOT / "docs" / "bench.json"), "--write-readme", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert readme.read_text() == f"intro\n{bench.FIGURES_BEGIN}\n{block}{bench.FIGURES_END}\nrest\n"
    assert json.loads((tmp_path / "docs" / "bench.json").read_text()) == json.loads((ROOT / "docs" / "bench.json").read_text())

    readme.write_text("no markers here\n")
    p = _collimate("--from-json", str(ROOT / "docs" / "bench.json"), "--write-readme", cwd=tmp_path)
    assert p.returncode != 0 and "has no figures block" in p.stderr and bench.FIGURES_BEGIN in p.stderr
    assert readme.read_text() == "no markers here\n"
