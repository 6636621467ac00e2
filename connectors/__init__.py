"""KV connectors: what moves KV blocks between the engine's GPU cache and the tiers.

The engine reaches a connector only through ``engine.kv_connector`` (its protocols and its
name -> class registry); nothing in engine/ imports this package (tests/test_layers.py).

- ``offload``: the offload connector (``connectors.offload.connector.OffloadConnector``): the
  scheduler side deciding what to save, load or recompute (torch-free), the worker side copying
  around the forward pass, their config, metadata, counters and start-up calibration.
- ``device``: the device-side copies they use (whole-block and 2-D copies, compressed-block
  decode, the lossless KV compression codec).
"""
