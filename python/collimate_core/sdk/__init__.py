"""The SDK a trainer calls: clients, sandboxes, sessions, fork groups, results, seeds, errors.

- client.py: `connect()`, which picks the embedded engine, the HTTP control plane or Ray;
- embedded.py: `EmbeddedClient`, the engine on this host (zygotes, spare clones, recycling, reaper);
- remote.py: `RemoteClient`, the same surface over the HTTP API;
- session.py: `Sandbox`, `Session`, `ForkGroup`, `Env`, `rollout_once` (over any client);
- results.py: `ExecResult`; seeds.py: seeds for deterministic replay;
- errors.py: the exception tree (one base, `CollimateError`); every layer raises these;
- quota.py: disk quotas (`disk_quota=`); meter.py: usage metering in time buckets;
- egress.py: `Egress`, the network policy of a sandbox (`egress=`; docs/egress.md).

These are the layer every other subpackage builds on (templates, grading, server and ray import
from here, never the other way round except for lazy imports at call time). The public names are
re-exported from `collimate_core`; nothing is imported here so that importing a submodule stays cheap
and free of cycles.
"""
