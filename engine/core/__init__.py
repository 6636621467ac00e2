"""The engine's two drivers: the core in its own process with the API-side client that talks to
it over ZMQ, and the in-process alternative.

``base`` holds what every engine front end shares (``EngineClient``, ``EngineDeadError``, the
per-request output mailbox); ``messages`` the msgpack wire format; ``proc`` the core process's
main loop; ``output_processor`` the API-side detokenization and stop strings; ``client`` the
``EngineCoreClient`` that spawns the core and serves ``generate`` from asyncio;
``async_engine`` the ``AsyncEngine`` that drives an ``LLMEngine`` on a thread of the API
process (``--engine-in-process``). Nothing is imported here, so ``import engine.core.messages``
stays free of torch.
"""
