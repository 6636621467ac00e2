"""The cache daemon (``kvtier cache-server``): a ``HierarchicalStore`` served over the network.

- ``daemon``: ``CacheServer``, the ZMQ loop and its worker pool; ``config``: its frozen
  ``ServerConfig``; ``cli``: the command line that builds the tiers, the store and the daemon.
- ``ops`` dispatches a request; ``puts`` / ``reads`` move payloads (frames, the client's shared
  memory segment); ``usage`` accounts bytes per namespace; ``leases`` lends host-slab blocks to
  same-host clients; ``doorbell`` serves the same-host Unix socket and the TCP stream.
- ``admin``: the HTTP side (health, Prometheus metrics, admin endpoints).

The wire (headers, framing, segments, authentication) belongs to ``tiers.remote``, which both
the daemon and its client import. Only this package and ``tiers.remote`` import zmq or sockets
(tests/test_layers.py). Importing the package itself imports nothing.
"""
