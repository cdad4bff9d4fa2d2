"""The cache's rules for writers (python/collimate_core/templates/cache.py), without KVM: one holder of an
entry's lock at a time across threads and processes, a killed owner's temporaries swept and a
live one's kept, and the key store, a writer of its own, losing no key to concurrent writers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from collimate_core.templates import cache as _cache
from collimate_core.server.keys import KeyStore

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}


def test_one_builder_per_entry_across_threads_and_processes(tmp_path):
    entry, calls = tmp_path / "thing", tmp_path / "calls"
    script = f"""
import os, time
from pathlib import Path
from collimate_core.templates import cache as _cache

def build(tmp):
    with open({str(calls)!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    time.sleep(0.3)  # a slow build: the others arrive meanwhile
    (tmp / "done").write_text("x")

_cache.build_once(Path({str(entry)!r}), lambda p: (p / "done").is_file(), build, kind="thing", key="k",
                  cache=Path({str(tmp_path)!r}))
"""
    procs = [subprocess.Popen([sys.executable, "-c", script], env=ENV) for _ in range(3)]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            exec(script, {})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(p.wait(timeout=120) == 0 for p in procs) and not errors, errors
    assert len(calls.read_text().splitlines()) == 1
    assert [r["kind"] for r in _cache.builds(tmp_path)] == ["thing"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builds.jsonl", "calls", "thing"]


def test_sweep_removes_a_killed_owners_temporary_and_keeps_a_live_ones(tmp_path):
    script = """
import sys, time
from pathlib import Path
from collimate_core.templates import cache as _cache
t = _cache.Temp(Path(sys.argv[1]) / "entry")
path = t.__enter__()
(path / "half").write_text("x")
print(path, flush=True)
time.sleep(3600)
"""
    owners = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env=ENV, text=True,
                               stdout=subprocess.PIPE) for _ in range(2)]
    try:
        killed, live = (Path(p.stdout.readline().strip()) for p in owners)
        assert killed.is_dir() and live.is_dir()
        owners[0].send_signal(signal.SIGKILL)
        owners[0].wait()
        assert _cache.sweep(tmp_path) == [killed]
        assert not killed.exists() and (live / "half").is_file()
    finally:
        for p in owners:
            p.kill()
            p.wait()
    assert _cache.sweep(tmp_path) == [live]
    assert list(tmp_path.iterdir()) == []


def test_a_lock_excludes_threads_of_one_process(tmp_path):
    inside, most, lock = [0], [0], threading.Lock()

    def hold() -> None:
        for _ in range(20):
            with _cache.Lock(tmp_path / "entry"):
                with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                time.sleep(0.001)
                with lock:
                    inside[0] -= 1

    threads = [threading.Thread(target=hold) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
    assert list(tmp_path.iterdir()) == []  # the lock file goes with its last holder


def test_concurrent_key_store_writers_lose_no_key(tmp_path):
    store = tmp_path / "keys.json"
    script = f"""
from collimate_core.server.keys import KeyStore
for i in range(5):
    KeyStore({str(store)!r}).create("t", note="p")
"""
    procs = [subprocess.Popen([sys.executable, "-c", script], env=ENV) for _ in range(3)]
    threads = [threading.Thread(target=lambda: [KeyStore(store).create("t", note="t") for _ in range(5)])
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(p.wait(timeout=120) == 0 for p in procs)
    records = KeyStore(store).list()
    assert len(records) == 30 and len({r.id for r in records}) == 30
    assert oct(store.stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.json"]
