"""The `serve`, `keys` and `openapi` subcommands of `collimate` (= `python -m collimate_core`)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="run the control-plane worker: the HTTP API over this host's engine")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8477, help="port (default 8477; 0 picks a free one, logged at start)")
    s.add_argument("--max-sandboxes", type=int, default=64, metavar="N", help="live sandboxes at most (default 64)")
    s.add_argument("--queue", type=int, default=256, metavar="N",
                   help="requests that may wait for capacity; more get 429 (default 256)")
    s.add_argument("--queue-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="longest wait in the queue before 429 (default 60)")
    s.add_argument("--idle-reap", type=float, default=600.0, metavar="SECONDS",
                   help="destroy sandboxes nobody touched for this long (default 600)")
    s.add_argument("--spend-limit", type=float, default=None, metavar="SANDBOX_SECONDS",
                   help="sandbox-seconds each tenant may use over the server's life (default: no limit)")
    s.add_argument("--max-upload", type=int, default=64 << 20, metavar="BYTES", help="largest upload (default 64 MiB)")
    s.add_argument("--max-download", type=int, default=256 << 20, metavar="BYTES",
                   help="largest file a download reads (default 256 MiB)")
    s.add_argument("--max-image-upload", type=int, default=4 << 30, metavar="BYTES",
                   help="largest image archive a tenant may upload to bake from (default 4 GiB)")
    s.add_argument("--max-bakes", type=int, default=2, metavar="N",
                   help="template bakes running at once; more get 429 (default 2)")
    s.add_argument("--image-quota", type=int, default=20 << 30, metavar="BYTES",
                   help="bytes of uploaded image archives each tenant may keep; an upload past it gets 413 "
                   "(default 20 GiB; 0: no quota)")
    s.add_argument("--cache", type=Path, default=None,
                   help="the cache directory: templates, tenants' images and templates (default: COLLIMATE_CACHE "
                   "or ~/.cache/collimate); the key store keeps its own default")
    s.add_argument("--key-store", type=Path, default=None, help="the key store (default: COLLIMATE_KEY_STORE or <cache>/keys.json)")
    s.add_argument("--preload", default="python", help="comma-separated templates to start at launch ('' for none)")
    s.add_argument("--disk-quota", default=None, metavar="SIZE",
                   help="each sandbox's /tmp and /work together, e.g. 512M (default: COLLIMATE_DISK_QUOTA "
                   "or 1G); also the most a request may ask for")
    s.add_argument("--shared-memory", default=None, metavar="SIZE",
                   help="each sandbox's shared memory (shared mappings, memfds and /dev/shm together), e.g. 256M "
                   "(default: COLLIMATE_SHARED_MEMORY or 512M); also the most a request may ask for")
    s.add_argument("--egress-ceiling", default=None, metavar="RULES",
                   help="the widest network policy a request may ask for: 'none', 'internet', or comma-separated "
                        "rules ('index.example.org,*.files.example.net,203.0.113.0/24'; add 'internet' to them); a wider "
                        "request gets 403 (default: no ceiling)")
    s.add_argument("--egress-max-flows", type=int, default=None, metavar="N",
                   help="the most flows (TCP connections and UDP flows) one sandbox holds open at once, 1..2000; past "
                        "it the guest's connect fails with EMFILE and the egress log says why (default: "
                        "COLLIMATE_EGRESS_MAX_FLOWS or 1024)")
    s.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="admit sandboxes while guest memory (1 GiB each), shared memory (--shared-memory) and disk "
                   "quota of all live ones together stay within SIZE, e.g. 200G; beyond it a create waits, then gets 429 (default: COLLIMATE_MEMORY_BUDGET "
                   "or no budget)")

    s.add_argument("--platform", default=None, choices=("auto", "kvm", "systrap"),
                   help="what sandboxes run on: kvm (a KVM virtual machine per process), systrap (a confined host "
                   "process under a trap-everything seccomp filter) or auto, which picks kvm where /dev/kvm creates a "
                   "VM (docs/platforms.md) (default: COLLIMATE_PLATFORM or auto)")

    k = sub.add_parser("keys", help="manage API keys: create, list, revoke")
    k.add_argument("--key-store", type=Path, default=None, help="the key store (default: COLLIMATE_KEY_STORE or <cache>/keys.json)")
    ks = k.add_subparsers(dest="keys_cmd", required=True)
    c = ks.add_parser("create", help="a new key for a tenant (printed once: it is stored hashed)")
    c.add_argument("--tenant", required=True)
    c.add_argument("--note", default="", help="a reminder of what the key is for")
    ks.add_parser("list", help="the keys (ids, tenants, dates; never the keys)").add_argument(
        "--json", action="store_true", help="one JSON document")
    r = ks.add_parser("revoke", help="revoke a key by id (takes effect on a running server at once)")
    r.add_argument("id")

    o = sub.add_parser("openapi", help="print the OpenAPI document (docs/openapi.json)")
    o.add_argument("--output", type=Path, default=None, help="write it here instead of stdout")


def run(args: argparse.Namespace) -> bool:
    """Run a subcommand of this module; False if `args.cmd` is not one."""
    if args.cmd == "serve":
        from collimate_core.server.app import serve
        from collimate_core.server.config import ServerConfig

        from collimate_core.sdk import quota as _quota
        from collimate_core.sdk.errors import InvalidArgument

        if args.image_quota < 0:
            sys.exit(f"collimate serve: --image-quota is a number of bytes >= 0 (0: no quota), not {args.image_quota}")
        try:
            disk_quota = _quota.disk_quota(args.disk_quota) if args.disk_quota else _quota.default_disk_quota()
            memory_budget = (_quota.parse_size(args.memory_budget, "--memory-budget") if args.memory_budget
                             else _quota.default_memory_budget())
            shared_memory = (_quota.shared_memory(args.shared_memory, memory_budget) if args.shared_memory
                             else _quota.default_shared_memory(memory_budget))
            from collimate_core.sdk.egress import parse_ceiling

            ceiling = parse_ceiling(args.egress_ceiling) if args.egress_ceiling is not None else None
            # A platform this host or build cannot serve stops the server here, saying why.
            from collimate_core.sdk import platform as _platform

            unavailable = _platform.problem(_platform.choose(_platform.requested(args.platform)))
            if unavailable:
                sys.exit(f"collimate serve: {unavailable}")
            if args.egress_max_flows is not None:
                from collimate_core.sdk.egress import set_max_flows

                set_max_flows(args.egress_max_flows)
        except InvalidArgument as e:
            sys.exit(f"collimate serve: {e}")

        serve(ServerConfig(
            host=args.host, port=args.port, max_sandboxes=args.max_sandboxes, queue=args.queue,
            queue_timeout=args.queue_timeout, idle_reap=args.idle_reap, spend_limit=args.spend_limit,
            max_upload=args.max_upload, max_download=args.max_download, max_image_upload=args.max_image_upload, max_bakes=args.max_bakes,
            image_quota=args.image_quota, cache=args.cache, key_store=args.key_store,
            preload=tuple(t for t in args.preload.split(",") if t),
            disk_quota=disk_quota, memory_budget=memory_budget, egress_ceiling=ceiling, shared_memory=shared_memory,
            platform=args.platform,
        ))
    elif args.cmd == "keys":
        _keys(args)
    elif args.cmd == "openapi":
        from collimate_core.server.app import openapi_json

        text = openapi_json()
        if args.output:
            args.output.write_text(text)
        else:
            sys.stdout.write(text)
    else:
        return False
    return True


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.datetime.fromtimestamp(t).isoformat(timespec="seconds")


def _keys(args: argparse.Namespace) -> None:
    from collimate_core.sdk.errors import CollimateError
    from collimate_core.server.keys import KeyStore

    store = KeyStore(args.key_store)
    try:
        if args.keys_cmd == "create":
            key, rec = store.create(args.tenant, args.note)
            print(key)
            print(f"key id {rec.id} for tenant {rec.tenant}: shown once, stored hashed in {store.path}", file=sys.stderr)
        elif args.keys_cmd == "list":
            recs = store.list()
            if args.json:
                print(json.dumps([r.public() for r in recs], indent=1))
                return
            print(f"{'ID':18} {'TENANT':20} {'CREATED':20} {'REVOKED':20} NOTE")
            for r in recs:
                print(f"{r.id:18} {r.tenant:20} {_when(r.created):20} {_when(r.revoked):20} {r.note}")
        elif args.keys_cmd == "revoke":
            rec = store.revoke(args.id)
            print(f"revoked key {rec.id} of tenant {rec.tenant}")
    except CollimateError as e:
        sys.exit(f"collimate keys: {e}")
