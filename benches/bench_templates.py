"""Ready state: what `Ready(code="import <slow module>")` saves at episode time.

The same image (the python template's root filesystem plus an app layer holding `slowmod`, a
module that does real work at import: tests/imagefixtures.py) is baked twice: with
Ready(code="import slowmod") and without a ready state. Each round forks a fresh sandbox (untimed)
and times exec(code="import slowmod") in it. The summary prints median and p99 of both and the
ratio of the medians (the issue's target: at least 10x). Timings are printed, never asserted.

Run: COLLIMATE_ROOTFS=$(python3 guest/rootfs/build.py) python3 -m pytest benches/bench_templates.py -q
"""

from __future__ import annotations

import math
import os
import statistics
import warnings

import pytest
from collimate_core import EmbeddedClient, Ready, Sandbox, Template
from imagefixtures import SLOWMOD, Layer, write_oci_layout

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

CODE = "import slowmod"
_medians: dict[str, list[float]] = {}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = os.environ.get("COLLIMATE_ROOTFS")
    if not root:
        pytest.skip("no python rootfs (set COLLIMATE_ROOTFS)")
    cache = tmp_path_factory.mktemp("bench-templates")
    base = Layer().tree(root, skip=(".collimate-rootfs.json",)).bytes()
    app = Layer().dir("srv").dir("srv/app").file("srv/app/slowmod.py", SLOWMOD).bytes()
    write_oci_layout(cache / "images" / "slowapp", [base, app],
                     {"Env": ["PATH=/usr/bin:/bin", "PYTHONPATH=/srv/app"], "WorkingDir": "/srv/app"})
    c = EmbeddedClient(cache=cache)
    warm = Template.bake(c, name="bench-warm", image="slowapp", ready=Ready(code=CODE))
    cold = Template.bake(c, name="bench-cold", image="slowapp")
    for h in (warm, cold):
        st = h.wait(600)
        assert st.phase == "Live", st.log
    yield c
    c.close()


def _p99(data: list[float]) -> float:
    s = sorted(data)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]


def _bench_import(benchmark, client, template: str, rounds: int) -> None:
    def setup():
        return (Sandbox(template, client=client).start(),), {}

    def run(sb):
        r = sb.exec(code=CODE, timeout_seconds=120)
        assert r.ok, r

    def teardown(sb):
        sb.kill()

    benchmark.pedantic(run, setup=setup, teardown=teardown, rounds=rounds, warmup_rounds=1)
    _medians[template] = list(benchmark.stats.stats.data)
    benchmark.extra_info["median_ms"] = round(benchmark.stats.stats.median * 1e3, 3)
    benchmark.extra_info["p99_ms"] = round(_p99(benchmark.stats.stats.data) * 1e3, 3)


def test_import_in_clone_without_ready_state(benchmark, client):
    """exec(code="import slowmod") in a fresh clone of the template baked without Ready."""
    _bench_import(benchmark, client, "bench-cold", rounds=15)


def test_import_in_clone_with_ready_state(benchmark, client):
    """exec(code="import slowmod") in a fresh clone of the template baked with Ready(code=...)."""
    _bench_import(benchmark, client, "bench-warm", rounds=50)
    cold, warm = _medians.get("bench-cold"), _medians["bench-warm"]
    if cold:
        med = statistics.median
        ratio = med(cold) / med(warm)
        benchmark.extra_info["cold_over_warm_median_ratio"] = round(ratio, 1)
        line = (f"import slowmod in a clone: without Ready median {med(cold) * 1e3:.2f} ms p99 {_p99(cold) * 1e3:.2f} ms; "
                f"with Ready(code=...) median {med(warm) * 1e3:.2f} ms p99 {_p99(warm) * 1e3:.2f} ms; "
                f"ratio {ratio:.1f}x (target >= 10x)")
        print("\n" + line)
        benchmark.extra_info["summary"] = line
        if ratio < 10:
            warnings.warn(f"the ready state saved less than 10x: {line}", stacklevel=1)
