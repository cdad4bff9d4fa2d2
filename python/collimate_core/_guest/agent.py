"""The in-guest agent: the zygote of the python template.

Runs inside the sandbox on Debian's CPython. It talks to the host over fd 3, a channel the engine
provides: each message is a 4-byte little-endian length and a JSON object. Reading fd 3 when no
request is queued pauses the sandbox, so an idle agent costs nothing and a template is checkpointed
exactly here, with every import of its ready state already done.

Requests:
  {"op": "exec", "code": str} or {"op": "exec", "command": str}, with optional "seed" (64 hex),
  "cwd", "env"; runs code in the agent's persistent namespace (state survives across execs, and
  forks of a live sandbox inherit it) or a shell command, and answers
  {"exit_code": int, "seed": hex|None, "seed_ack": str, "duration": float}.
  {"op": "ping"} answers {"pong": true}.
"""

import hashlib
import os
import random
import sys
import time
import traceback

CHANNEL = 3
ACK_CONTEXT = b"collimate/seed-ack/v1"
RANDOM_CONTEXT = b"collimate/python-random/v1"


def _read_exact(n):
    chunks = []
    while n:
        b = os.read(CHANNEL, n)
        if not b:
            raise EOFError("agent channel closed")
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def recv():
    import json

    size = int.from_bytes(_read_exact(4), "little")
    return json.loads(_read_exact(size))


def send(obj):
    import json

    data = json.dumps(obj).encode()
    os.write(CHANNEL, len(data).to_bytes(4, "little") + data)


def reseed(seed_hex):
    """Reseed the user-space PRNGs this interpreter hosts from the (already reseeded) sandbox CRNG,
    and return the ack: a checksum over the seed and the first CRNG bytes seen after the reseed,
    which the host recomputes."""
    seed = bytes.fromhex(seed_hex)
    first = os.urandom(32)
    random.seed(int.from_bytes(hashlib.sha256(RANDOM_CONTEXT + seed).digest(), "big"))
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(int.from_bytes(hashlib.sha256(RANDOM_CONTEXT + b"numpy" + seed).digest()[:4], "big"))
    return hashlib.sha256(ACK_CONTEXT + seed + first).hexdigest()


def run_code(code, namespace):
    try:
        exec(compile(code, "<exec>", "exec"), namespace)
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - a user error is reported, never kills the agent
        traceback.print_exc()
        return 1


def run_command(command, env, cwd):
    import subprocess

    try:
        return subprocess.run(["/bin/sh", "-c", command], env=env, cwd=cwd).returncode
    except OSError as e:
        print(f"cannot run the command: {e}", file=sys.stderr)
        return 127


def main():
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    while True:
        req = recv()
        op = req.get("op")
        if op == "ping":
            send({"pong": True})
            continue
        if op != "exec":
            send({"error": f"unknown op {op!r}"})
            continue
        start = time.monotonic()
        seed = req.get("seed")
        ack = reseed(seed) if seed else None
        cwd = req.get("cwd")
        if cwd:
            os.chdir(cwd)
        if req.get("code") is not None:
            code = run_code(req["code"], namespace)
        else:
            env = dict(os.environ)
            env.update(req.get("env") or {})
            code = run_command(req["command"], env, cwd)
        sys.stdout.flush()
        sys.stderr.flush()
        send({"exit_code": code, "seed_ack": ack, "duration": time.monotonic() - start})


if __name__ == "__main__":
    main()
