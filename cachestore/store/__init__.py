"""The hierarchical store: one ordered stack of tiers behind one get / put / lookup.

- ``hierarchical``: ``HierarchicalStore``; ``types``: its config and result types
  (``StoreConfig``, ``WritePolicy``, ``LookupResult``, ``PinningTier``).
- Its satellites: ``guarded_tiers`` (tier calls behind the failure backoff), ``loads`` (a
  prepared load's ``LoadSpec`` and the one owner of its pins, ``prepare_load`` to
  ``complete_load``), ``pins`` (keys in flight, and the per-key load claims), ``demotion`` (the background movers:
  promotions up, evictions one tier down), ``writes`` (one tier's write, the movers' write-back,
  the shutdown flush), ``reads`` (top-down reads and the lookup), ``write_through`` (per-tier
  write policies), ``host`` (the fast path into the host tier's slab), ``metrics`` (per-tier
  counters, rate estimates and backoff).

Torch-free; imports tiers/, never engine/ or connectors/ (tests/test_layers.py). Importing the
package itself imports nothing.
"""
