"""OpenAI-compatible HTTP serving on top of ``LLMEngine``.

The engine core runs in its own process (``engine.core.client``: ZMQ, msgpack) by default;
``engine.core.async_engine`` is the in-process alternative (one background thread,
``--engine-in-process``).
``api`` builds the FastAPI app; ``protocol`` holds the request models, ``responses`` the
response models; ``metrics`` the Prometheus registry (its families declared in
``metric_families``); ``cli`` is ``kvtier serve``. Nothing is imported here so that ``import engine.server.protocol`` stays
light.
"""
