"""OpenAI-compatible HTTP serving on top of ``LLMEngine``.

``async_engine`` drives one engine from one background thread and hands results to asyncio;
``api`` builds the FastAPI app; ``protocol`` holds the request/response models; ``metrics``
the Prometheus registry; ``cli`` is ``kvtier serve``. Nothing is imported here so that
``import engine.server.protocol`` stays light.
"""
