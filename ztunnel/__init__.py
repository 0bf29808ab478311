"""ztunnel: the per-node L4 proxy of Istio's ambient mesh, in Python."""

__version__ = "0.1.0"
