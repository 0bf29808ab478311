"""HBONE: HTTP/2 CONNECT tunnels over mTLS (sans-IO h2 endpoint, drivers, connection pool).

``h2conn`` is the protocol core: a lean sans-IO HTTP/2 connection (client and server) with a
zero-copy DATA path. It never touches sockets or TLS; drivers move its bytes. ``transport`` is
that driver over TLS, ``pool`` shares its connections, and ``budget`` bounds what all of a
process's connections hold in memory.
"""
