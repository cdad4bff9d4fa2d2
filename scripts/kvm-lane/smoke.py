"""The SDK smoke of the upstream-KVM lane: the seeds' RL quickstart on the embedded engine.

rollout_once with a seed (the seed-ack must say "verified"), a fork group whose children each run,
and a replay (the same seed twice gives the same bytes). Exits non-zero on the first difference.
"""
import sys

from collimate_rl import Sandbox, connect, rollout_once

SEED = ("c0ffee" * 11)[:64]  # 32 bytes as 64 hex digits
DRAW = "import os, random; print(os.urandom(8).hex(), random.random())"


def check(what, ok, detail=""):
    print(f"smoke: {what}: {'ok' if ok else 'FAILED'} {detail}".rstrip(), flush=True)
    if not ok:
        sys.exit(1)


client = connect()
r = rollout_once("python", code="print(sum(range(1000)))", seed=SEED, client=client)
check("rollout_once", r.ok and r.stdout.strip() == "499500", repr((r.stdout, r.stderr[-300:])))
check("seed_ack", r.seed_ack == "verified", repr(r.seed_ack))

first = rollout_once("python", code=DRAW, seed=SEED, client=client)
again = rollout_once("python", code=DRAW, seed=SEED, client=client)
check("replay", first.ok and first.stdout == again.stdout and first.stdout.strip() != "", repr((first.stdout, again.stdout)))

with Sandbox("python", client=client) as sb:
    sb.exec(code="x = 41")
    with sb.fork_group(3, seed=SEED) as group:
        outs = group.map(lambda i, child: child.exec(code=f"x += {i}; print(x)").stdout.strip())
    check("fork_group", outs == ["41", "42", "43"], repr(outs))
