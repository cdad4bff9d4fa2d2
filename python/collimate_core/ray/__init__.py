"""Scale-out on Ray: one host actor per KVM node, and a client with the SDK's surface over them.

    pip install collimate-core[ray]
    ray start --head --resources='{"collimate_host": 64}'      # on every KVM node: its slot count
    collimate ray-host --address auto                          # start the host actors (once)
    client = connect(ray="auto")                               # or COLLIMATE_RAY_ADDRESS

Hosts. A node advertises the custom resource `collimate_host` with its slot count (the sandboxes
it may hold at once). `start_hosts()` (what `collimate ray-host` runs; `connect(ray=...)` does it
too for nodes that have none yet) starts one `HostActor` on each such node, pinned there by hard
node affinity (a VM pool cannot move), named `collimate-host-<node id>` in the `collimate`
namespace and detached, so every driver of the cluster shares it. The actor wraps that node's
embedded engine (`EmbeddedClient`): zygotes, spare clones, recycling, metering, as on one host.
It is a threaded actor: its calls run concurrently, each a blocking engine call with the GIL
released, exactly as the embedded client's own threads.

Placement (by template warmth, decided in the driver, written to `client.placement_log`):
- a session (a sandbox made from a template) goes to a host where that template is warm (its
  zygote is running) or warming (a first sandbox of it is being made there) and a slot is free,
  least loaded first; to a cold host (least loaded) only when no such host has a free slot, so a
  host makes one cold start of a template at a time; CapacityError when no host has a slot;
- a fork group and every later call on a sandbox go to the host holding its VM: a group is never
  split, and children run next to their parent's memory;
- `client.env(ref, width=N)` spreads the expected width over the hosts (N / hosts each), which
  warms the template on all of them.

Templates: `Template.bake(client, ...)` bakes on every host into its own engine (the image must be
reachable under the same path or store reference on each node), and the template is warm on every
host that baked it; `Template.list/get/delete` work as on one host.

Failure: a host that is lost (its node removed, its actor dead) makes every call on it raise
`HostLost` (a `GroupError`, so a fork group's map raises it as is, and never a reward); the host is
dropped from placement, and later sessions go to the hosts that are left. Nothing is retried
behind the caller's back: resampling a group is the caller's explicit, idempotent call.

Leases: a host destroys a sandbox nobody touched for its lease (`RayClient(lease=)`, or
COLLIMATE_RAY_LEASE; default 600 s), never one in a call; a client's daemon thread touches what it
holds every lease / 3, so a driver that dies leaves no sandbox running past its lease.

Every `ExecResult` of this client carries `host`, the Ray node id it ran on.
"""
