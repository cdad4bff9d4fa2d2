"""Templates: what a sandbox is forked from, and the on-disk cache they live in.

- catalog.py: the built-in templates (the python template: Debian's CPython with the in-guest agent
  of ../guest/, checkpointed at its ready point), the snapshot store's entries (`Baked`) and the
  agent's channel framing;
- bake.py: `Template.bake` from an image (`Template`, `Ready`, `TemplateHandle`): the bake, its
  ready point, the template store;
- image.py: `Image`, the SDK's image builder (Debian packages, PyPI wheels, local files; cached
  content-addressed layers; an OCI layout out);
- oci.py: OCI images and `docker save` archives: digests, layers, the image store, a root filesystem
  from an image;
- rootfs.py: the python template's root filesystem recipe from Debian's packages (stdlib only: also
  loaded by file path from guest/rootfs/build.py, without collimate_core);
- cache.py: the cache's rules for writers (one builder per entry, locks, temporaries swept after a
  killed writer); stdlib only, loaded by path from rootfs.py in that case.

They sit together because a template's digest depends on all of them: its image, its root
filesystem, the agent and the snapshot format. Nothing is imported here (no cycles, cheap imports).
"""
