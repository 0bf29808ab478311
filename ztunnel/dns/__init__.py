"""The DNS proxy on 15053 (``istio/ztunnel:src/dns/``).

Layers, top to bottom: ``server`` (UDP and TCP listeners beside each ProxyInstance, bounds,
metrics), ``forwarder`` (ztunnel's own resolv.conf, marked upstream sockets, the response cache),
``wire`` (the message format: dnspython, plus a measured fast path for one-question A/AAAA
queries), ``resolver`` (the pure answer decision over the State) and ``names`` (name expansion).
``dns`` sits above ``proxy`` in the import order: ``proxy`` never imports it.
"""
