#!/usr/bin/env python3
"""Build a template root filesystem; print its path. The logic: python/collimate_core/templates/rootfs.py."""
import argparse, importlib.util, pathlib, signal, sys

_src = pathlib.Path(__file__).resolve().parents[2] / "python/collimate_core/templates/rootfs.py"
_spec = importlib.util.spec_from_file_location("collimate_rootfs", _src)
rootfs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rootfs)
build_rootfs, RootfsError, RECIPES = rootfs.build_rootfs, rootfs.RootfsError, rootfs.RECIPES

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cache", help="cache dir (default: $COLLIMATE_CACHE, $XDG_CACHE_HOME/collimate "
                    "or ~/.cache/collimate)")
    ap.add_argument("--name", default="python", choices=sorted(RECIPES), help="recipe")
    ap.add_argument("--force", action="store_true", help="rebuild even if the tree exists")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup of a partial tree
    try:
        print(build_rootfs(args.name, args.cache, lambda m: print(m, file=sys.stderr), args.force))
    except RootfsError as e:
        sys.exit(f"build.py: error: {e}")
