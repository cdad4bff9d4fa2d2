"""The in-guest side of reward grading (see grade.py). Stdlib only.

grade.py sends this file's source into the sandbox before any candidate runs (on the embedded
engine, once: the prepared sandbox is checkpointed as a template, see pool.py; otherwise
once per group, in the parent sandbox that is forked) and executes it in a private namespace whose
builtins are a copy taken then. `install()` imports the modules the tests use, records what the
interpreter looks like before the candidate (every loaded module's attributes, sys.modules, the
builtins), refuses later audit hooks, caps the sandbox's processes (RLIMIT_NPROC), freezes the
objects alive so far out of the garbage collector's way, and returns `run`: the only name it
leaves in the candidate's namespace.

After the candidate ran, the host sends `run(globals(), seal, kind, payload)`, which carries the
tests and the per-grade verdict token, sealed (two random halves, joined only to report). Before
each test (each top-level statement of the tests; each trial of a property), `run` puts back what
the tests can see as it was before the candidate: the attributes and sys.modules entries of the
modules the tests import (`math.fabs = ...`), the builtins module (`builtins.all = ...`), trace
and profile hooks; and the test code gets a fresh copy of the builtins, so a candidate that patches
builtins while it is being called does not reach the asserts around the call. The strict
equality and the report use references taken before the candidate ran (`os.write`, `json.dumps`).
The verdict is one line, `token + JSON list of booleans`, written to fd 1, and only by the
sandbox's agent process (a process the candidate forks during the tests runs a copy of `run`).

Known limit: the candidate runs in this interpreter, so code written against this harness (ctypes,
walking frames or gc to find `run`'s token) can still forge a verdict; the harness stops generic
monkeypatching, not an adversary who has read this file.
"""

import builtins as _builtins
import sys as _sys

_NUMBERS = (int, float)
_PLAIN = (int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset)


def _number(x):
    """The plain int or float value of `x` (an int or float, or a subclass of one), without
    calling any method a subclass overrides."""
    t = type(x)
    if t is int or t is float:
        return x
    if isinstance(x, int):
        return int.__add__(x, 0)
    return float.__add__(x, 0.0)


def strict_eq(a, b):
    """`a == b` for grading: builtin values must have the same type (int and float mix, bool does
    not), containers compare element by element, and anything else must say equal both ways."""
    ta, tb = type(a), type(b)
    if isinstance(a, _PLAIN) or isinstance(b, _PLAIN):
        if ta is not tb:
            if ta is not bool and tb is not bool and isinstance(a, _NUMBERS) and isinstance(b, _NUMBERS):
                return _number(a) == _number(b)
            return False
        if ta is list or ta is tuple:
            if len(a) != len(b):
                return False
            for x, y in zip(a, b):
                if not strict_eq(x, y):
                    return False
            return True
        if ta is dict:
            if a.keys() != b.keys():
                return False
            for k in a:
                if not strict_eq(a[k], b[k]):
                    return False
            return True
    return bool(a == b) is True and bool(b == a) is True


# Processes a grading sandbox may have at once (its RLIMIT_NPROC; the engine's own cap is 256). A
# fork bomb then runs into EAGAIN within a few dozen forks and ends with an OSError instead of
# keeping the host busy making VMs until its timeout, and the sandbox's reset has few processes to
# kill. Guests run as root, so a candidate can raise it again; a generic fork bomb does not.
MAX_PROCESSES = 32


def install(preload=()):
    """Import `preload` (the modules the tests import), snapshot the interpreter, deny audit hooks
    from now on, cap the processes, and return the test runner."""
    import copy as _copy
    import json as _json
    import os as _os
    import random as _random

    for name in preload:
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - a test importing a missing module fails by itself
            pass
    # A module that is not there yet (a test's `from solution import f`, the candidate writing
    # solution.py) must still be found later: forget the directory listings cached meanwhile.
    import importlib

    importlib.invalidate_caches()
    write, dumps, deepcopy, Random = _os.write, _json.dumps, _copy.deepcopy, _random.Random
    getpid = _os.getpid
    agent_pid = getpid()
    random_class = dict(vars(Random))
    settrace, setprofile = _sys.settrace, _sys.setprofile
    modules = _sys.modules
    snapshot = {}
    for name, m in list(modules.items()):
        try:
            d = vars(m)
        except TypeError:
            continue
        if isinstance(d, dict):
            snapshot[name] = (m, dict(d))
    builtins_now = snapshot["builtins"][1]
    # Copies of the builtins for the tests' namespaces, made here so that a freshly forked sandbox
    # does not pay for copying (every page a fork touches first costs a trip to the host).
    spare_builtins = [dict(builtins_now) for _ in range(8)]

    def deny_audit_hooks(event, args):
        # An audit hook sees every compile and exec, so one added by a candidate would see the
        # tests and the token when they arrive. Raising RuntimeError here refuses it quietly.
        if event == "sys.addaudithook":
            raise RuntimeError("grading: audit hooks are not available to graded code")

    _sys.addaudithook(deny_audit_hooks)
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
    except (ImportError, OSError, ValueError):
        pass
    # Everything alive now is part of every grading sandbox: keep the garbage collector's passes
    # off it, so that a collection during a candidate does not write to (and so copy) every page
    # holding an object of the template.
    import gc

    gc.collect()
    gc.freeze()

    def fresh_builtins():
        return spare_builtins.pop() if spare_builtins else dict(builtins_now)

    def restore(ns, names):
        """Undo the candidate's monkeypatching where the tests can see it: the builtins, and the
        modules the tests import (their attributes, their sys.modules entries). Only those: each
        page touched for the first time in a freshly forked sandbox costs a trip to the host."""
        for name in names:
            entry = snapshot.get(name)
            if entry is not None:
                m, attrs = entry
                if modules.get(name) is not m:
                    modules[name] = m
                vars(m).update(attrs)
        vars(_builtins).update(builtins_now)
        settrace(None)
        setprofile(None)
        ns["__builtins__"] = fresh_builtins()

    def report(seal, results):
        # Only the sandbox's agent reports: a process the candidate forked during the tests runs
        # a copy of this runner and would print a verdict of its own.
        if getpid() != agent_pid:
            return
        # The token exists as a string only from here on, after the last test: while the tests
        # run, a frame holds two random halves of it.
        nonce = format(int(seal[0], 16) ^ int(seal[1], 16), "032x")
        data = ("\n__collimate_verdict_" + nonce + ":" + dumps(results) + "\n").encode()
        while data:
            data = data[write(1, data) :]

    def unit(ns, seal, payload):
        eq_name, names = payload["eq"], payload["modules"]
        results = []
        for src in payload["tests"]:
            restore(ns, names)
            ns[eq_name] = strict_eq
            try:
                exec(compile(src, "<test>", "exec"), ns)
                results.append(True)
            except BaseException:  # noqa: BLE001 - any failure of a test is that test failing
                results.append(False)
        report(seal, results)

    def restore_random():
        # The generator's input comes from random.Random: put its methods back too.
        for k in [k for k in vars(Random) if k not in random_class]:
            delattr(Random, k)
        for k, v in random_class.items():
            if vars(Random).get(k) is not v:
                setattr(Random, k, v)

    def prop(ns, seal, spec):
        names = spec["modules"]
        restore(ns, names)
        restore_random()
        private = {"__builtins__": fresh_builtins(), "__name__": "__collimate_property__"}
        exec(compile(spec["reference"], "<reference>", "exec"), private)
        exec(compile(spec["generator"], "<generator>", "exec"), private)
        reference, gen = private["reference"], private["gen"]
        rng = Random(int(spec["seed"], 16))
        results = []
        for _ in range(spec["trials"]):
            restore(ns, names)
            restore_random()
            x = gen(rng)
            args = x if isinstance(x, tuple) else (x,)
            try:
                want = reference(*deepcopy(args))
                fn = ns[spec["function"]]
                results.append(bool(strict_eq(fn(*deepcopy(args)), want)))
            except BaseException:  # noqa: BLE001 - the candidate failing a trial
                results.append(False)
        report(seal, results)

    # The agent's own reseeding of the user-space PRNGs (guest/agent.py), taken now: before the
    # tests of a one-exec grade (see `run`) it does what the agent does at the start of an exec.
    agent = modules.get("collimate_agent")
    seed_prngs = getattr(agent, "seed_prngs", None)
    from traceback import print_exc

    def run_candidate(ns, code):
        """Run the candidate's code in `ns` as the agent runs an exec's code; its exit status."""
        try:
            exec(compile(code, "<exec>", "exec"), ns)
            return 0
        except SystemExit as e:
            if e.code is None:
                return 0
            if isinstance(e.code, int):
                return e.code
            print(e.code, file=_sys.stderr)
            return 1
        except BaseException:  # noqa: BLE001 - the candidate failing, reported as the agent does
            print_exc()
            return 1

    def flush():
        for stream in (_sys.stdout, _sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001 - a candidate's replaced stream
                pass

    def run(ns, seal, kind, payload, candidate=None):
        # One exec per grade: `candidate` = (code, seed, phase). The candidate's top-level code
        # runs first, as an exec of its own would; a failure ends the exec with its status (the
        # host scores it, as before, without tests). Then a line with `phase` tells the host the
        # tests started, the PRNGs are reseeded from the grade's seed as the agent reseeds them
        # at an exec's start, and the tests run.
        if candidate is not None:
            code, seed_hex, phase = candidate
            status = run_candidate(ns, code)
            flush()
            if status != 0:
                raise SystemExit(status)
            data = ("\n__collimate_phase_" + phase + "\n").encode()
            while data:
                data = data[write(1, data) :]
            if seed_prngs is not None and seed_hex:
                seed_prngs(bytes.fromhex(seed_hex))
        if kind == "unit":
            unit(ns, seal, payload)
        else:
            prop(ns, seal, payload)

    return run
