"""Workloads, services and authorization policies: the mesh as ztunnel knows it."""
