"""``kvtier demo``: a multi-turn chat workload with KV offload, on a real or the tiny model.

``run`` is the subcommand (arguments, the workload, its summary); ``chat`` chooses the model
and writes the real-model conversation. Nothing is imported here.
"""
