"""The in-guest agent: the zygote of the python template.

Runs inside the sandbox on Debian's CPython. It talks to the host over fd 3, a channel the engine
provides: each message is a 4-byte little-endian length and a JSON object. Reading fd 3 when no
request is queued pauses the sandbox, so an idle agent costs nothing and a template is checkpointed
exactly here, with every import of its ready state already done.

Requests:
  {"op": "exec", "code": str} or {"op": "exec", "command": str}, with optional "seed" (64 hex),
  "cwd", "env"; runs code in the agent's persistent namespace (state survives across execs, and
  forks of a live sandbox inherit it) or a shell command, and answers
  {"exit_code": int, "seed_ack": str|None} (the ack is described in `reseed`).
  {"op": "ping"} answers {"pong": true}.
"""

import os
import random
import sys
import traceback

try:
    # CPython's own SHA-256 (built into the interpreter): hashlib's is OpenSSL's, whose code and
    # data pages every exec in a fresh clone would otherwise touch (shadow page faults) for three
    # hashes of a few dozen bytes.
    from _sha256 import sha256
except ImportError:  # an interpreter built without it
    from hashlib import sha256

CHANNEL = 3
# Names the host set for this interpreter only (unbuffered output, no .pyc in a read-only root),
# comma-separated, in this variable: they are dropped from the environment at start, so
# commands and the processes code starts get the image's environment and what the exec passes.
AGENT_ENV = "COLLIMATE_AGENT_ENV"
ACK_CONTEXT = b"collimate/seed-ack/v1"
RANDOM_CONTEXT = b"collimate/python-random/v1"


def _drop_agent_env():
    for name in os.environ.pop(AGENT_ENV, "").split(","):
        if name:
            os.environ.pop(name, None)


_drop_agent_env()

_pending = bytearray()  # bytes read from the channel beyond the last message


def _read_exact(n):
    # Reads in chunks of at least 16 KiB: a request (header and body) usually arrives in one read,
    # one VM exit instead of two. (Not larger: a bigger buffer costs an mmap and page faults.)
    while len(_pending) < n:
        b = os.read(CHANNEL, max(16384, n - len(_pending)))
        if not b:
            raise EOFError("agent channel closed")
        _pending.extend(b)
    out = bytes(_pending[:n])
    del _pending[:n]
    return out


def recv():
    import json

    size = int.from_bytes(_read_exact(4), "little")
    return json.loads(_read_exact(size))


def send(obj):
    import json

    data = json.dumps(obj).encode()
    os.write(CHANNEL, len(data).to_bytes(4, "little") + data)


def seed_prngs(material):
    """Seed the user-space PRNGs this interpreter hosts (random, and numpy's global generator if
    numpy is loaded) from 32 bytes of `material`."""
    random.seed(int.from_bytes(sha256(RANDOM_CONTEXT + material).digest(), "big"))
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(int.from_bytes(sha256(RANDOM_CONTEXT + b"numpy" + material).digest()[:4], "big"))


def reseed(seed_hex):
    """Reseed the user-space PRNGs from the seed, and return the ack: a checksum over the seed and
    the first sandbox CRNG bytes seen after the host's reseed, which the host recomputes.

    Without a seed, the PRNGs are seeded from the sandbox CRNG (fresh in every clone) and there is
    no ack: they were seeded before the template's ready point, so every clone of the template
    would otherwise draw the same `random` numbers."""
    if not seed_hex:
        seed_prngs(os.urandom(32))
        return None
    seed = bytes.fromhex(seed_hex)
    first = os.urandom(32)
    seed_prngs(seed)
    return sha256(ACK_CONTEXT + seed + first).hexdigest()


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


# The engine's spawn call (not Linux): spawn(path, argv, envp, flags) starts `path` as a child
# process in one call, without the vfork child's pre-exec code (about 68 syscalls, each a VM exit,
# in CPython's _posixsubprocess). Flags: keep only fds 0-2 (close_fds=True), SIGPIPE and SIGXFSZ
# back to their default (restore_signals=True): what subprocess.run does by default.
SYS_SPAWN = 0x4000_0001
SPAWN_CLOSE_FDS = 1
SPAWN_RESTORE_SIGNALS = 2


def _spawn_call():
    """libc's syscall() set up for the spawn call, or None (no ctypes in this interpreter)."""
    try:
        import ctypes

        f = ctypes.CDLL(None, use_errno=True).syscall
    except (ImportError, OSError, AttributeError):
        return None
    strv = ctypes.POINTER(ctypes.c_char_p)
    f.restype = ctypes.c_long
    f.argtypes = (ctypes.c_long, ctypes.c_char_p, strv, strv, ctypes.c_long)

    def spawn(argv, envp):
        a = (ctypes.c_char_p * (len(argv) + 1))(*argv, None)
        e = (ctypes.c_char_p * (len(envp) + 1))(*envp, None)
        pid = f(SYS_SPAWN, argv[0], a, e, SPAWN_CLOSE_FDS | SPAWN_RESTORE_SIGNALS)
        if pid < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return pid

    return spawn


# Set up at start, before the template's ready point: an exec pays only for the call.
_spawn = _spawn_call()


def _encode_env(env):
    """envp for the spawn call, or None where subprocess would refuse it (its error is reported)."""
    out = []
    for k, v in env.items():
        k, v = os.fsencode(k), os.fsencode(v)
        if not k or b"=" in k or b"\0" in k or b"\0" in v:
            return None
        out.append(k + b"=" + v)
    return out


def run_command(command, env, cwd):
    script = os.fsencode(command)
    envp = _encode_env(env) if _spawn is not None and b"\0" not in script else None
    if envp is not None:
        try:
            pid = _spawn([b"/bin/sh", b"-c", script], envp)
        except OSError as e:
            # ENOSYS: not served in place (user code started threads): subprocess below.
            if e.errno != 38:
                print(f"cannot run the command: {e}", file=sys.stderr)
                return 127
        else:
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:  # reaped by user code's SIGCHLD handler (subprocess says 0 too)
                return 0
            rc = os.waitstatus_to_exitcode(status)
            # A shell killed by a signal is reported as shells report it: 128 + the signal number.
            return 128 - rc if rc < 0 else rc
    import subprocess

    try:
        rc = subprocess.run(["/bin/sh", "-c", command], env=env, cwd=cwd).returncode
        # A shell killed by a signal is reported as shells report it: 128 + the signal number.
        return 128 - rc if rc < 0 else rc
    except (OSError, ValueError) as e:
        print(f"cannot run the command: {e}", file=sys.stderr)
        return 127


def main():
    # The user's code runs in a module of its own that is `__main__` (this agent's own globals
    # stay its functions'), as a script's does: what it defines pickles by reference
    # (multiprocessing.Pool.map of a function defined in an exec, a class's instances).
    import types

    user = types.ModuleType("__main__")
    user.__builtins__ = __builtins__
    # The agent itself stays importable by a name of its own (tests look at its state there).
    sys.modules["collimate_agent"] = sys.modules[__name__]
    sys.modules["__main__"] = user
    namespace = user.__dict__
    while True:
        req = recv()
        op = req.get("op")
        if op == "ping":
            send({"pong": True})
            continue
        if op != "exec":
            send({"error": f"unknown op {op!r}"})
            continue
        seed = req.get("seed")
        ack = reseed(seed)
        cwd = req.get("cwd")
        if cwd:
            try:
                os.chdir(cwd)
            except OSError as e:
                # Not the user's program failing: the host raises InvalidArgument with this.
                send({"cwd_error": f"{e.strerror} (errno {e.errno})", "seed_ack": ack})
                continue
        if req.get("code") is not None:
            code = run_code(req["code"], namespace)
        else:
            env = dict(os.environ)
            env.update(req.get("env") or {})
            code = run_command(req["command"], env, cwd)
        sys.stdout.flush()
        sys.stderr.flush()
        # No timing here: the host measures the run, and every clock read is a VM exit.
        send({"exit_code": code, "seed_ack": ack})


if __name__ == "__main__":
    main()
