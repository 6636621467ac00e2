"""The engine core in its own process, and the API-side client that talks to it over ZMQ.

``base`` holds what every engine front end shares (``EngineClient``, ``EngineDeadError``, the
per-request output mailbox); ``messages`` the msgpack wire format; ``proc`` the core process's
main loop; ``output_processor`` the API-side detokenization and stop strings; ``client`` the
``EngineCoreClient`` that spawns the core and serves ``generate`` from asyncio. Nothing is
imported here, so ``import engine.core.messages`` stays free of torch.
"""
