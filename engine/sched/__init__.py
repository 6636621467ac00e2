"""The scheduler's side of the engine: which requests run this step, and which KV blocks hold them.

``scheduler`` picks the step (chunked prefill, preemption, the connector's hooks) with
``admission`` (a new head's prefix hit and connector hooks), ``kv_loads`` (requests whose KV
loads from lower tiers) and ``first_tokens`` (short steps for first tokens);
``kv_cache_manager`` gives requests their blocks, reusing cached prefixes; ``block_pool`` holds
the blocks, their hashes and the free list. Pure bookkeeping: nothing here touches a device or
imports torch (tests/test_layers.py keeps it so). Nothing is imported here.
"""
