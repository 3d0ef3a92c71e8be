"""The audit stores behind one backend contract: SQLite and GhostPod objects."""
