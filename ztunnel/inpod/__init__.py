"""In-pod mode: the ZDS protocol with the istio-cni node agent and the per-pod proxies it drives.

``protocol`` is the sans-IO codec and session rules, ``client`` the socket driver (ztunnel is the
ZDS client), ``zds_pb2`` the generated protobuf module (``scripts/gen-protos.sh``).
"""
