"""Checkpoints: the commit protocol (manifest with sizes and sha256, verified before any resume)."""
