"""The in-guest side of stdin/stdout grading (IOTestReward, see iotest.py). Stdlib only.

iotest.py sends this file's source into the sandbox before any candidate runs (on the embedded
engine once: the prepared sandbox is checkpointed as a template) and runs `install()` in a private
namespace. `install` imports the modules programs commonly use, caps the sandbox's processes
(RLIMIT_NPROC), freezes the objects alive so far out of the garbage collector's way, and returns
two functions, which the host keeps under private names in the agent's namespace:

- `run(code, stdin, memory_limit)`: run `code` as the main program of a fresh interpreter would,
  once: fd 0 reads `stdin` (bytes, or the path of a file the host uploaded; a file either way),
  sys.stdin/stdout/stderr are new text streams over fds 0, 1, 2
  (block-buffered stdout, flushed at the end as an interpreter's exit does), `__name__ ==
  "__main__"` in a new `__main__` module, `sys.argv == ["solution.py"]`. The exec's exit code is
  the program's exit status (SystemExit as CPython maps it, 1 for an uncaught exception); its
  stdout is the program's output. A MemoryError, or memory in use above `memory_limit` bytes at a
  garbage-collector pass or at the end, ends the program with MEMORY_EXIT. The host resets the
  sandbox after every case, so nothing the program did survives it.
- `check(seal, source, name, items)`: after the cases ran, in a sandbox reset to the prepared state
  (no candidate code ever ran in it): the spec's checker `name(input, output, expected)` over
  `items`, reported as one line `token + JSON list of booleans`.
"""

MEMORY_EXIT = 203  # the program's exit status when it went over its memory limit


def install(preload=(), max_processes=32):
    import builtins
    import gc
    import importlib
    import io
    import json
    import os
    import sys
    import traceback
    import types

    for name in preload:
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - a module missing from this template
            pass
    importlib.invalidate_caches()

    in_use = None
    try:
        import ctypes

        class _MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in
                        ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                         "uordblks", "fordblks", "keepcost")]

        _mallinfo2 = ctypes.CDLL(None).mallinfo2
        _mallinfo2.restype = _MallInfo2
        _mallinfo2.argtypes = []

        def in_use():
            m = _mallinfo2()
            return m.uordblks + m.hblkhd  # heap bytes allocated + bytes in mmapped chunks

        in_use()
    except (ImportError, AttributeError, OSError):
        in_use = None

    try:
        import resource

        resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
    except (ImportError, OSError, ValueError):
        pass

    write, dumps, _exit = os.write, json.dumps, os._exit
    SystemExit_, MemoryError_, BaseException_ = SystemExit, MemoryError, BaseException
    stdin_path = "/tmp/.collimate-stdin"
    def fresh():
        """New standard streams over fds 0, 1, 2 and a new __main__ module, as an interpreter starts with."""
        inp = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", errors="strict")
        out = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8",
                               errors="strict")
        err = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
                               errors="backslashreplace", line_buffering=True)
        main = types.ModuleType("__main__")
        main.__dict__.update({"__builtins__": builtins, "__file__": "solution.py"})
        return inp, out, err, main

    # Made once, here, in the prepared state: every case starts from that state (the host resets
    # the sandbox after each, or forks a fresh child of it), so each gets them unused, without
    # paying for building them in a fresh sandbox (every page it touches first is a trip to the host).
    spare = [fresh()]
    gc.collect()
    gc.freeze()

    def say(fd, text):
        data = text.encode("utf-8", "backslashreplace")
        while data:
            data = data[write(fd, data):]

    def exit_status(e):
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        try:
            print(code, file=sys.stderr)
        except BaseException_:  # noqa: BLE001
            pass
        return 1

    previous = []  # the last case's __main__, when the host did not reset the sandbox since

    def run(code, stdin, memory_limit=None):
        if previous:
            # A case after another in the same interpreter: end the last program's objects first
            # (a file it opened on fd 0 closes that fd when collected, which must not be this
            # case's stdin).
            m = previous.pop()
            try:
                m.__dict__.clear()
            except BaseException_:  # noqa: BLE001
                pass
            del m
            gc.collect()
        if isinstance(stdin, str):
            # A large input the host uploaded as a file (iotest.py's _STDIN_UPLOAD).
            path = stdin
            fd = os.open(path, os.O_RDONLY)
        else:
            path = stdin_path
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            view = memoryview(stdin)
            while view:
                view = view[write(fd, view):]
            os.lseek(fd, 0, 0)
        if fd != 0:  # (0 when the last program closed its stdin)
            os.dup2(fd, 0)
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except BaseException_:  # noqa: BLE001
                pass
        inp, out, err, main = spare.pop() if spare else fresh()
        sys.stdin = sys.__stdin__ = inp
        sys.stdout = sys.__stdout__ = out
        sys.stderr = sys.__stderr__ = err
        sys.modules["__main__"] = main
        previous.append(main)
        sys.argv = ["solution.py"]
        if memory_limit and in_use is not None:
            def watch(phase, info):
                if phase == "start" and in_use() > memory_limit:
                    say(2, f"\ncollimate: memory limit exceeded ({in_use() >> 20} MiB in use)\n")
                    _exit(MEMORY_EXIT)

            gc.callbacks.append(watch)
        else:
            watch = None
        status = 0
        try:
            exec(compile(code, "solution.py", "exec"), main.__dict__)
        except SystemExit_ as e:
            status = exit_status(e)
        except MemoryError_:
            status = MEMORY_EXIT
            say(2, "\nMemoryError\n")
        except BaseException_ as e:  # noqa: BLE001 - the program's uncaught exception
            status = 1
            try:  # as the interpreter prints it: from the program's frames on
                traceback.print_exception(type(e), e, e.__traceback__.tb_next)
            except BaseException_:  # noqa: BLE001
                say(2, "\nan uncaught exception\n")
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except BaseException_:  # noqa: BLE001 - as CPython: a failed flush at exit is status 120
                if status == 0:
                    status = 120
        if watch is not None:
            try:  # (a sandbox not reset between cases runs the next case in this interpreter)
                gc.callbacks.remove(watch)
            except BaseException_:  # noqa: BLE001 - the program emptied the list itself
                pass
        if memory_limit and in_use is not None and in_use() > memory_limit:
            say(2, f"\ncollimate: memory limit exceeded ({in_use() >> 20} MiB in use at exit)\n")
            status = MEMORY_EXIT
        raise SystemExit_(status)

    def check(seal, source, name, items):
        ns = {"__builtins__": dict(vars(builtins)), "__name__": "__collimate_checker__"}
        exec(compile(source, "<checker>", "exec"), ns)
        fn = ns[name]
        results = []
        for inp, output, expected in items:
            try:
                results.append(bool(fn(inp, output, expected)))
            except BaseException_:  # noqa: BLE001 - a checker that raises rejects the output
                results.append(False)
        nonce = format(int(seal[0], 16) ^ int(seal[1], 16), "032x")
        say(1, "\n__collimate_verdict_" + nonce + ":" + dumps(results) + "\n")

    return run, check
