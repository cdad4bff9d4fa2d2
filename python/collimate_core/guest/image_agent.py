"""The in-guest agent of templates baked from a container image that has Python.

It is agent.py (same channel, framing, persistent namespace and seed-ack), with command execs
that honour the image: a command runs as `ENTRYPOINT... SHELL -c COMMAND` (what `docker run IMAGE
sh -c COMMAND` runs), or, in an image without /bin/sh, as ENTRYPOINT... followed by the command's
words (shlex); an empty command runs the image's default, `ENTRYPOINT... CMD...`. The exec's
environment is the image's Env with the exec's env on top, in the image's WorkingDir unless the
exec names a cwd.

argv[1] is the image's settings as JSON: {"entrypoint": [...], "cmd": [...], "shell": str|null}.
Code execs see sys.path and sys.argv as under `python -c` (the current directory first).
"""

import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import agent

try:
    _CFG = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
except ValueError:
    _CFG = {}
ENTRYPOINT = [str(a) for a in _CFG.get("entrypoint") or []]
CMD = [str(a) for a in _CFG.get("cmd") or []]
SHELL = _CFG.get("shell") or None


def command_argv(command):
    """The argv a command exec runs."""
    if not command.strip():
        return ENTRYPOINT + CMD
    if SHELL:
        return ENTRYPOINT + [SHELL, "-c", command]
    import shlex

    return ENTRYPOINT + shlex.split(command)


def run_command(command, env, cwd):
    import subprocess

    try:
        argv = command_argv(command)
    except ValueError as e:  # unbalanced quotes without a shell
        print(f"collimate: cannot split the command into words: {e}", file=sys.stderr)
        return 2
    if not argv:
        print("collimate: the command is empty and the image declares no Entrypoint or Cmd", file=sys.stderr)
        return 127
    try:
        rc = subprocess.run(argv, env=env, cwd=cwd, check=False).returncode
    except FileNotFoundError as e:
        print(f"collimate: cannot run {argv[0]}: {e.strerror}", file=sys.stderr)
        return 127
    except OSError as e:
        print(f"collimate: cannot run {argv[0]}: {e.strerror or e}", file=sys.stderr)
        return 126
    return 128 - rc if rc < 0 else rc


agent.run_command = run_command

if __name__ == "__main__":
    # Code execs run as under `python -c`: the current directory first on sys.path, not ours.
    if sys.path and sys.path[0] == _HERE:
        sys.path[0] = ""
    sys.argv = ["-c"]
    agent.main()
