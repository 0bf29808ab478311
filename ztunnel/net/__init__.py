"""Sockets, namespaces and byte copying: the thin I/O layer."""
