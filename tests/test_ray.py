"""Scale-out on Ray, on one machine: `ray.cluster_utils.Cluster` with a head (no collimate host) and
two worker nodes advertising the `collimate_host` resource, all on loopback.

`collimate ray-host` starts the host actors; the SDK's sync and aio surfaces run on
`connect(ray=ADDRESS)`. Shown: groups land whole on one node, placement follows template warmth
then load (read from the client's placement log), a node removed mid-group raises HostLost with
nothing scored, later sessions go to the node that is left, and after the cluster shuts down no VMM
process of a host is left. Skipped when Ray is not installed (`pip install collimate-core[ray]`).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

import collimate_core  # noqa: E402
from collimate_rl import HostLost, Sandbox, UnitTestReward, aio, connect, grade_batch, rollout_once  # noqa: E402
from hostprocs import GONE, alive  # noqa: E402

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

PKG = str(Path(collimate_core.__file__).resolve().parent.parent)
SLOTS = 24


def host_vmms(token: str = "") -> list[int]:
    """VMM processes started by collimate host actors (their environment carries the host token),
    or by the one whose token is `token`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if b"_vmm_main" not in (d / "cmdline").read_bytes():
                continue
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        mine = [e for e in env if e.startswith(b"COLLIMATE_HOST_TOKEN=")]
        if mine and (not token or mine[0] == b"COLLIMATE_HOST_TOKEN=" + token.encode()) and state not in GONE:
            out.append(int(d.name))
    return out




def _until(cond, what: str, bound: float = 60.0) -> None:
    end = time.monotonic() + bound  # a bound on the wait, not a timing assertion
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"never: {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster():
    if PKG not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # Ray's workers import collimate_core
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (PKG, os.environ.get("PYTHONPATH")) if p)
    os.environ.pop("COLLIMATE_RAY_ADDRESS", None)
    assert host_vmms() == []
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        # lose a removed node within about two seconds, not thirty
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                           "health_check_initial_delay_ms": 0},
    })
    workers = [c.add_node(num_cpus=1, resources={"collimate_host": SLOTS}) for _ in range(2)]
    c.wait_for_nodes()
    # `collimate ray-host`, as an operator runs it: a driver of its own that starts detached actors
    out = subprocess.run([sys.executable, "-m", "collimate_core", "ray-host", "--address", c.address],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(line.split()[1].rstrip(":") for line in out.stdout.splitlines() if line.startswith("host ")) == \
        sorted(w.node_id for w in workers)
    c.workers = workers
    yield c
    ray.shutdown()
    c.shutdown()
    _until(lambda: host_vmms() == [], "no host VMM process left after the cluster shut down")


@pytest.fixture(scope="module")
def client(cluster):
    return connect(ray=cluster.address)


def _creates(client, since: int) -> list[dict]:
    return [e for e in client.placement_log[since:] if e["op"] == "create"]


def test_hosts_are_the_nodes_with_the_resource(cluster, client):
    assert isinstance(client, collimate_core.RayClient)
    assert connect(ray=cluster.address) is client  # shared per address
    hosts = client.hosts()
    assert sorted(h["node_id"] for h in hosts) == sorted(w.node_id for w in cluster.workers)
    assert all(h["slots"] == SLOTS and h["lost"] is None for h in hosts)
    assert cluster.head_node.node_id not in {h["node_id"] for h in hosts}


def test_a_burst_on_a_cold_template_makes_one_cold_start(client):
    from concurrent.futures import ThreadPoolExecutor

    assert all("python" not in h["warm"] for h in client.hosts())
    mark = len(client.placement_log)

    def one(i):
        with Sandbox("python", client=client) as sb:
            return sb.exec(code=f"print({i})").host

    with ThreadPoolExecutor(6) as pool:
        hosts = list(pool.map(one, range(6)))
    creates = _creates(client, mark)
    assert [e["reason"] for e in creates].count("cold") == 1  # the others waited for it: warming, then warm
    assert len(set(hosts)) == 1 and {e["host"] for e in creates} == set(hosts)
    assert [h["node_id"] for h in client.hosts() if "python" in h["warm"]] == hosts[:1]


def test_groups_land_whole_and_placement_follows_warmth(client):
    mark = len(client.placement_log)
    warm_host = next(h["node_id"] for h in client.hosts() if "python" in h["warm"])
    with client.session("python") as sess:  # warm on one host only: there
        r = sess.exec(code="prefix = 40")
        home = r.host
        assert home == warm_host
        assert home in {h["node_id"] for h in client.hosts()}
        with sess.fork_group(8) as grp:
            out = grp.map(lambda i, c: c.exec(code=f"print(prefix + {i})"))
        assert [o.stdout for o in out] == [f"{40 + i}\n" for i in range(8)]
        assert {o.host for o in out} == {home}  # the group whole, on its parent's host
        fork = [e for e in client.placement_log[mark:] if e["op"] == "fork"]
        assert fork and fork[-1]["host"] == home and fork[-1]["width"] == 8
        # the template is warm on `home` only: a new session goes there although it holds more
        # (the other host holds none)
        with Sandbox("python", client=client) as other:
            assert other.exec(code="print(1)").host == home
    first, second = _creates(client, mark)
    assert first["reason"] == "warm" and first["host"] == home and first["load"] == 0
    assert second["reason"] == "warm" and second["host"] == home and second["warm_hosts"] == [home]
    assert second["load"] == 1  # the parent was live (its group had gone)


def test_env_spreads_width_and_sessions_go_least_loaded(client):
    mark = len(client.placement_log)
    with client.env("python", width=8) as env:  # each host keeps its share ready: warm on both
        assert sorted(e["host"] for e in client.placement_log[mark:] if e["op"] == "expect") == \
            sorted(h["node_id"] for h in client.hosts())
        with env.sandbox() as a, env.sandbox() as b:
            ha, hb = a.exec(code="print(1)").host, b.exec(code="print(2)").host
    assert ha != hb  # both warm: the second to the less loaded
    assert [e["reason"] for e in _creates(client, mark)] == ["warm", "warm"]


def test_rollout_once_and_grading_on_ray(client):
    r = rollout_once("python", code="print(sum(range(1000)))", seed="c0ffee" * 10 + "c0ff", client=client)
    assert r.ok and r.stdout == "499500\n" and r.seed_ack == "verified" and r.host is not None
    spec = UnitTestReward(tests="assert solve([3,1,2]) == [1,2,3]\n", timeout_seconds=2)
    codes = ["def solve(xs):\n    return sorted(xs)\n", "def solve(xs):\n    return xs\n", "import os; os._exit(0)"]
    assert [g.reward for g in grade_batch(codes, spec, client=client)] == [1.0, 0.0, 0.0]


def test_the_aio_client_on_ray(cluster, client):
    async def run():
        ac = await aio.connect(ray=cluster.address)
        assert ac.sync is client
        r = await aio.rollout_once("python", code="print(7)", client=ac)
        async with ac.session("python") as sess:
            await sess.exec(code="base = 100")
            async with sess.fork_group(8) as grp:
                async def run(i, child):
                    return await child.exec(code=f"print(base + {i})")
                out = await grp.map(run)
                seen = {i: res.stdout async for i, res in grp.as_completed(run)}
        return r, out, seen

    r, out, seen = asyncio.run(run())
    assert r.stdout == "7\n"
    assert [o.stdout for o in out] == [f"{100 + i}\n" for i in range(8)]
    assert len({o.host for o in out}) == 1
    assert seen == {i: f"{100 + i}\n" for i in range(8)}


def _utime(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11])


def test_cancelling_an_aio_exec_on_ray_frees_its_sandbox(cluster, client):
    async def run():
        ac = await aio.connect(ray=cluster.address)
        sb = await aio.Sandbox("python", client=ac).start()
        actor = client._hosts[sb.sync._box.host].actor
        live = ray.get(actor.info.remote())["live"]
        pid = ray.get(actor.vmm_pid.remote(sb.session_id))
        busy = _utime(pid)
        task = asyncio.create_task(sb.exec(code="while True: pass", timeout_seconds=300))
        for _ in range(3000):  # until the guest spins: the exec is in flight on the host
            if _utime(pid) > busy + 20:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the guest never ran")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return actor, live, pid, sb

    actor, live, pid, sb = asyncio.run(run())
    assert sb.sync._box is None and not alive(pid)  # killed on its host, not left to its timeout
    assert ray.get(actor.info.remote())["live"] == live - 1


def test_templates_are_baked_on_every_host(client, tmp_path):
    root = os.environ.get("COLLIMATE_ROOTFS")
    if not root:
        pytest.skip("no python rootfs (set COLLIMATE_ROOTFS: python3 guest/rootfs/build.py)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from imagefixtures import Layer, busybox_layer, write_docker_save

    from collimate_rl import Ready, Template

    extra = Layer().dir("work").file("etc/motd", b"ray motd\n").bytes()
    image = tmp_path / "tool.tar"  # one machine: every node sees this path
    write_docker_save(image, [busybox_layer(Path(root) / "usr/bin/busybox"), extra],
                      {"Env": ["PATH=/bin"], "WorkingDir": "/work"}, repo_tags=["tool:1.0"])
    mark = len(client.placement_log)
    handle = Template.bake(client, name="raytool", image=str(image), ready=Ready(cmd="echo warm > /work/w"))
    assert handle.wait(timeout=300).phase == "Live"
    assert sorted(e["host"] for e in client.placement_log[mark:] if e["op"] == "bake") == \
        sorted(h["node_id"] for h in client.hosts() if not h["lost"])
    assert all("raytool" in h["warm"] for h in client.hosts() if not h["lost"])

    async def use():
        ac = await aio.connect(ray=client.address)
        h = await aio.Template.get(ac, "raytool")
        async with ac.session(h) as sess:
            return await sess.exec(command="cat /etc/motd /work/w")

    r = asyncio.run(use())
    assert r.ok and r.stdout == "ray motd\nwarm\n" and r.host is not None
    assert _creates(client, mark)[-1]["reason"] == "warm"
    Template.delete(client, "raytool")
    with pytest.raises(collimate_core.NotFoundError):
        Template.get(client, "raytool")


DRIVER = """
import sys
from collimate_core import Sandbox, connect
client = connect(ray=sys.argv[1])
sb = Sandbox("python", client=client).start()
sb.exec(code="print(1)")
print(sb.session_id, sb._box.host, flush=True)
sys.stdin.read()  # until killed
"""


def test_egress_policies_on_ray(client):
    """Egress through a host actor as through the embedded engine: a session's policy reaches its
    server (a counting HTTP server on this machine's loopback), its fork group inherits it, a
    live change forbids the next request, the log lists the flows, and no policy is no network."""
    import http.server
    import threading

    from collimate_rl import Egress

    class Counting(http.server.BaseHTTPRequestHandler):
        hits = 0

        def do_GET(self):
            type(self).hits += 1
            self.send_response(200)
            self.send_header("Content-Length", "3")
            self.end_headers()
            self.wfile.write(b"ok\n")

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    get = (
        "import urllib.request\n"
        "try:\n"
        f"    print(urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=10).read().decode(), end='')\n"
        "except Exception as e:\n"
        "    print('ERR', type(getattr(e, 'reason', e)).__name__)\n"
    )
    try:
        with client.session("python", egress=Egress.allow(f"127.0.0.1:{port}")) as sess:
            assert sess.exec(code=get).stdout == "ok\n"
            with sess.fork_group(2) as grp:
                assert grp.map(lambda i, child: child.exec(code=get).stdout) == ["ok\n", "ok\n"]
            assert any(e.get("port") == port for e in sess.egress_log())
            sess.set_egress(Egress.none())
            assert sess.exec(code=get).stdout.startswith("ERR")
        with client.session("python") as plain:
            assert plain.exec(code=get).stdout.startswith("ERR")
        assert Counting.hits == 3
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_dead_drivers_sandboxes_go_at_the_end_of_their_lease(cluster, client):
    env = dict(os.environ, COLLIMATE_RAY_LEASE="2")
    p = subprocess.Popen([sys.executable, "-c", DRIVER, cluster.address], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        box_id, host = p.stdout.readline().split()
        actor = client._hosts[host].actor
        pid = ray.get(actor.vmm_pid.remote(box_id))
        time.sleep(3)  # longer than the lease: the live driver's keepalive holds it
        assert alive(pid)
        live = ray.get(actor.info.remote())["live"]  # (info touches no sandbox)
    finally:
        p.kill()
        p.wait()
    # (its VMM process may live on, reset, in the host's pool of recycled sandboxes)
    _until(lambda: ray.get(actor.info.remote())["live"] == live - 1,
           "the dead driver's sandbox reaped at the end of its lease")
    assert ray.get(actor.keepalive.remote([box_id])) == [box_id]  # gone from its host


def test_a_node_removed_mid_group_raises_host_lost_and_nothing_is_scored(cluster, client):
    scored: list[int] = []
    with client.session("python") as sess:
        home = sess.exec(code="print(0)").host
        victim = next(w for w in cluster.workers if w.node_id == home)
        info = ray.get(client._hosts[home].actor.info.remote())
        actor_pid = info["pid"]
        with sess.fork_group(4) as grp:
            def run(i, child):
                if i == 0:
                    cluster.remove_node(victim, allow_graceful=False)
                    _until(lambda: not alive(actor_pid), "the host actor's process ending")
                    r = child.exec(code="print(0)")
                else:
                    r = child.exec(code="while True: pass", timeout_seconds=300)  # in flight when it goes
                scored.append(i)
                return 1.0 if r.ok else 0.0

            with pytest.raises(HostLost, match="lost"):
                grp.map(run)
            assert len(grp) == 0
    assert scored == []
    # its guests, spinning when it went, did not outlive it (its watchdog)
    _until(lambda: host_vmms(info["token"]) == [], "the lost host's VMM processes ending")
    lost = [e for e in client.placement_log if e["op"] == "lost"]
    assert [e["host"] for e in lost] == [home]
    assert [h["lost"] is not None for h in client.hosts() if h["node_id"] == home] == [True]

    # later groups go to the node that is left, sync and aio
    survivor = next(w.node_id for w in cluster.workers if w.node_id != home)
    mark = len(client.placement_log)
    with client.session("python") as sess:
        sess.exec(code="x = 1")
        with sess.fork_group(4) as grp:
            assert {o.host for o in grp.map(lambda i, c: c.exec(code="print(x)"))} == {survivor}

    async def again():
        async with (await aio.connect(ray=cluster.address)).session("python") as s:
            return (await s.exec(code="print(2)")).host

    assert asyncio.run(again()) == survivor
    assert {e["host"] for e in _creates(client, mark)} == {survivor}


def test_platform_passes_through_to_the_hosts_and_every_sandbox_and_result_names_it(cluster, client):
    # The hosts chose when `collimate ray-host` started them (auto: kvm here); the sandboxes and
    # results say so, and a client asking for another platform uses none of them, saying why.
    assert client.platform == "kvm" and {h["platform"] for h in client.hosts()} == {"kvm"}
    assert connect(ray=cluster.address, platform="kvm").platform == "kvm"
    with pytest.raises(collimate_core.InvalidArgument, match=r"platform='systrap'.*already runs another platform"):
        connect(ray=cluster.address, platform="systrap")
    with pytest.raises(collimate_core.InvalidArgument, match="'auto', 'kvm' or 'systrap'"):
        connect(ray=cluster.address, platform="bogus")
    with Sandbox("python", client=client) as sb:
        assert sb.platform == "kvm"
        r = sb.exec(command="true")
        assert r.ok and r.platform == "kvm" and r.host == sb._box.host
        with sb.fork_group(2) as group:
            assert [c.platform for c in group] == ["kvm", "kvm"]


def test_hosts_that_cannot_serve_their_platform_say_why(cluster, client):
    # Last: it stops the hosts. Started on a platform this build cannot serve, a host actor stays
    # up saying why; `collimate ray-host` and every client say so instead of finding no host.
    from collimate_core.sdk import platform as pf

    if pf.binding_serves_systrap() and pf.SDK_SERVES_SYSTRAP:
        pytest.skip("this build serves systrap sandboxes")
    collimate_core.ray.host.stop_hosts()
    out = subprocess.run([sys.executable, "-m", "collimate_core", "ray-host", "--address", cluster.address,
                          "--platform", "systrap"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "collimate ray-host: no collimate host of this cluster can run sandboxes: host " in out.stderr
    assert "platform='systrap' was asked for, but this build of collimate_core does not serve systrap" in out.stderr
    for platform in ("auto", "systrap"):  # new clients (connect(ray=...) alone is the one made earlier)
        with pytest.raises(collimate_core.PlatformUnavailable, match="does not serve systrap sandboxes yet"):
            connect(ray=cluster.address, platform=platform)
    collimate_core.ray.host.stop_hosts()
