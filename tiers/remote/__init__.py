"""The ``remote`` tier and the wire it shares with the cache daemon (``cachestore.server``).

- ``tier``: ``RemoteTier``, the client; ``conn`` (ZMQ connections), ``bell`` (same-host
  doorbell and TCP stream clients) under it.
- The wire both ends speak, owned here so the daemon imports it from its client's side and
  tiers/ never imports cachestore/: ``protocol`` (headers, limits, tokens, checksums),
  ``bell_framing`` (doorbell/stream framing), ``shm`` (shared-memory segments), ``zap`` (ZMQ
  authentication).

Only this package and ``cachestore.server`` import zmq or sockets (tests/test_layers.py).
Importing the package itself imports nothing.
"""
