"""The offload connector: GPU KV blocks saved to a ``HierarchicalStore``, loaded back on a hit.

- ``connector``: ``OffloadConnector``, built by ``engine.kv_connector.create_kv_connector``
  (name ``offload``) from ``config`` (``OffloadConfig``); it owns the store and both sides.
- ``scheduler``: the scheduler side (``OffloadScheduler``): lookups, the reload-versus-recompute
  decision, what to save, load or cancel each step. Torch-free (tests/test_layers.py).
- ``worker``: the worker side (``OffloadWorker``) with ``saves`` and ``loads`` (copies around
  the forward pass, on a side stream on CUDA).
- ``metadata``: the values crossing from one side to the other; ``stats``: counters;
  ``calibration``: timing prefills through the engine at start.

Importing the package itself imports nothing.
"""
