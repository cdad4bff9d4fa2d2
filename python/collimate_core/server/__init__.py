"""The control plane (placeholder, split in the next commit)."""
