"""Debian's torch in a sandbox (issue 15): `torch.set_num_threads(2)` gives the same results as one
thread, in a sandbox that shows 2 CPUs while its threads take turns on one vCPU.

The image is the catalog python rootfs plus what `RUN apt-get install -y python3-torch` adds
(Debian 12: torch 1.13 built with OpenMP, the reference BLAS; tests/imagefixtures.py
`torch_image`), baked with the Pro quickstart's `Ready(cmd="python3 -c 'import torch'")` and
`cpus=2`. torch's parallel kernels (at::parallel_for on OpenMP) split work across threads, each
computing whole output elements, so elementwise ops, sorting, convolution and a training step of
a small network are bit-identical with 1 and 2 threads; a reduction (sum) may add its partial sums
in another order, as natively, so it is compared to rounding. The worker thread is seen running
(/proc/self/task). The one-thread results are also bit-identical to the same program run
natively on the very files of the sandbox (the unpacked image, through its own loader).

The .debs (~235 MiB, 357 packages) are downloaded once into the deb cache (COLLIMATE_DEB_CACHE);
without apt-get/dpkg the test skips, but a failed download fails it. 2.5 minutes after the first
download on a loaded 2-core host (the 1 GiB layer and its bytecode ~1-2 min, the bake ~35 s, the
work in a sandbox ~10-25 s; benches/bench_torch.py times the import).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from collimate_core import EmbeddedClient, Ready, Sandbox, Template
from collimate_core.templates import cache as _cache
from collimate_core.templates.bake import load_template

sys.path.insert(0, str(Path(__file__).resolve().parent))
from imagefixtures import native_python, torch_image  # noqa: E402

HAVE_KVM = os.path.exists("/dev/kvm") and bool(os.environ.get("COLLIMATE_ROOTFS"))
pytestmark = [pytest.mark.kvm,
              pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm and COLLIMATE_ROOTFS (a built rootfs)")]

READY = "python3 -c 'import torch'"

# One JSON line: the results of the same work with 1 and with 2 threads, as hashes of the bytes.
WORK = r'''
import copy, hashlib, json, os, sys
import torch

def h(t):
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()

default = torch.get_num_threads()
torch.set_num_threads(1)
torch.manual_seed(20251202)
a = torch.randn(256, 256, dtype=torch.float64)
b = torch.randn(256, 256, dtype=torch.float64)
big = torch.randn(1 << 20, dtype=torch.float64)
images = torch.randn(8, 3, 32, 32)
conv = torch.nn.Conv2d(3, 16, 3)
mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
data, target = torch.randn(512, 64), torch.randint(0, 10, (512,))

def run(n):
    torch.set_num_threads(n)
    out = {"threads": torch.get_num_threads()}
    out["elementwise"] = h(torch.exp(big).sin() * 3 + big)  # 1M elements: split across the threads
    out["tasks"] = len(os.listdir("/proc/self/task"))  # the OpenMP team stays up between regions
    out["matmul"] = h(a @ b)
    out["sort"] = h(torch.sort(big).values)
    with torch.no_grad():
        out["conv"] = h(conv(images))
    m = copy.deepcopy(mlp)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(m(data), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    out["train"] = h(torch.cat([p.flatten() for p in m.parameters()]))
    out["loss"] = loss.item()
    out["sum"] = big.sum().item()
    return out

print(json.dumps({"version": torch.__version__, "cpu_count": os.cpu_count(), "default": default,
                  "one": run(1), "two": run(2)}))
'''

EXACT = ("elementwise", "matmul", "sort", "conv", "train", "loss")


@pytest.fixture(scope="module")
def baked(tmp_path_factory):
    """A cache of this file's own with the torch image baked as template "torch" (2 CPUs);
    yields the client and the template's unpacked root filesystem."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        pytest.skip("needs Debian's apt-get and dpkg to add python3-torch to the image")
    cache = tmp_path_factory.mktemp("torch-cache")
    (cache / "images").mkdir()
    ref = torch_image(cache / "images", os.environ["COLLIMATE_ROOTFS"], _cache.deb_dir(_cache.cache_dir()))
    client = EmbeddedClient(cache=cache)
    try:
        st = Template.bake(client, name="torch", image=ref, ready=Ready(cmd=READY), cpus=2).wait(900)
        assert st.phase == "Live", (st.error, st.log[-4000:])
        assert f'Ready(cmd=...): running "{READY}"' in st.log
        yield client, Path(load_template("torch", cache).meta["rootfs"])
    finally:
        client.close()


def in_sandbox(client, program: str) -> dict:
    with Sandbox("torch", client=client) as sb:
        sb.upload_bytes("/work/work.py", program.encode())
        r = sb.exec(command="python3 /work/work.py", timeout_seconds=600)
    assert r.exit_code == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def natively(root: Path, program: str, tmp_path: Path) -> dict:
    (tmp_path / "work.py").write_text(program)
    argv, env = native_python(root)
    r = subprocess.run([*argv, str(tmp_path / "work.py")], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_set_num_threads_two_gives_the_results_of_one(baked, tmp_path):
    client, root = baked
    g = in_sandbox(client, WORK)
    assert g["version"].startswith("1.13") and g["cpu_count"] == 2
    # (torch's default, g["default"], counts physical cores through cpuinfo: 1 here, as natively.)
    one, two = g["one"], g["two"]
    assert (one["threads"], two["threads"]) == (1, 2)
    assert two["tasks"] >= one["tasks"] + 1, ("no OpenMP worker thread ran", one["tasks"], two["tasks"])
    assert {k: two[k] for k in EXACT} == {k: one[k] for k in EXACT}
    assert math.isclose(two["sum"], one["sum"], rel_tol=1e-12), (one["sum"], two["sum"])

    # The same program on the host, on the sandbox's own files: the same bytes.
    n = natively(root, WORK, tmp_path)
    assert n["version"] == g["version"]
    assert {k: n["one"][k] for k in (*EXACT, "sum")} == {k: one[k] for k in (*EXACT, "sum")}
    assert {k: n["two"][k] for k in EXACT} == {k: two[k] for k in EXACT}

