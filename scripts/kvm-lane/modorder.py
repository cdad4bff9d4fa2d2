#!/usr/bin/env python3
"""Print the kernel modules needed for the given ones, dependencies first, one path a line.

Usage: modorder.py MODULES_DIR NAME...   (MODULES_DIR: a kernel's lib/modules/<version>/kernel)

A Debian kernel package ships no modules.dep (depmod writes it at installation), so the
dependencies are read from each module's own .modinfo section: the `depends=` string.
"""
import lzma
import os
import sys


def modinfo_depends(path):
    data = open(path, "rb").read()
    if path.endswith(".xz"):
        data = lzma.decompress(data)
    key = b"\0depends="
    at = data.find(key)
    if at < 0:
        return []
    end = data.index(b"\0", at + len(key))
    return [d for d in data[at + len(key):end].decode().split(",") if d]


def canonical(name):
    return name.replace("-", "_")


def main():
    root, wanted = sys.argv[1], sys.argv[2:]
    paths = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            for ext in (".ko", ".ko.xz"):
                if f.endswith(ext):
                    paths[canonical(f[: -len(ext)])] = os.path.join(dirpath, f)
    order, done = [], set()

    def add(name, chain=()):
        name = canonical(name)
        if name in done:
            return
        if name not in paths:
            sys.exit(f"modorder: no module {name} under {root} (needed by {' <- '.join(chain) or 'the command line'})")
        done.add(name)
        for dep in modinfo_depends(paths[name]):
            add(dep, chain + (name,))
        order.append(paths[name])

    for w in wanted:
        add(w)
    print("\n".join(order))


if __name__ == "__main__":
    main()
