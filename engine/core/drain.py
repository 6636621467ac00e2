"""Closing an engine at shutdown and judging its KV drain, for the exit codes that tell a
supervisor whether the host tier's blocks reached the tiers below.

``LLMEngine.close`` closes the offload connector, which drains the write-through queues and
flushes host-only blocks down (``HierarchicalStore.shutdown_writes``, bounded by the offload
config's ``drain_timeout_s`` twice). ``close_and_judge`` runs it and reads the store's
``drain_report``: a drain that dropped queued copies or left host-only blocks unwritten lost
them (the host tier is memory), and the engine core then exits with ``EXIT_DRAIN_INCOMPLETE``.
Torch-free.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

EXIT_OK = 0  # Shutdown or parent death, and the KV drain completed (or there was none)
EXIT_FAILED = 1  # a step raised, or the engine could not be built or closed
EXIT_DRAIN_INCOMPLETE = 3  # stopped as asked, but the KV drain lost blocks


def close_and_judge(engine: Any) -> int:
    """Closes ``engine`` (an ``LLMEngine``; flushes and drains its KV offload) and returns the
    exit code that says how it went: ``EXIT_OK`` when nothing was lost (or there was no
    offload), ``EXIT_DRAIN_INCOMPLETE`` when the drain lost blocks, ``EXIT_FAILED`` when the
    close raised. Logs the verdict (losses at error level). Never raises; call once, on the
    engine's thread, after its last step."""
    try:
        engine.close()
    except Exception:  # noqa: BLE001 - exiting anyway; the exit code and the log say why
        logger.exception("closing the engine failed: its KV offload may not have drained")
        return EXIT_FAILED
    report = None if engine.kv_connector is None else engine.kv_connector.store.drain_report
    if report is None:
        return EXIT_OK  # no KV offload: nothing to drain
    where = f" to {report.flush_tier}" if report.flush_tier else ""
    if report.dropped or report.flush_left:
        logger.error(
            "KV drain incomplete after %.2fs: %d host-only blocks not flushed%s and %d "
            "queued write-through copies dropped: lost to a restart (raise "
            "drain_timeout_s, or check the tier below)",
            report.seconds,
            report.flush_left,
            where,
            report.dropped,
        )
        return EXIT_DRAIN_INCOMPLETE
    logger.info(
        "KV drain complete in %.2fs: %d host-only blocks flushed%s, %d already there, "
        "%d queued copies written",
        report.seconds,
        report.flushed,
        where,
        report.flush_present,
        report.drained,
    )
    return EXIT_OK


def describe_exit(code: int | None) -> str | None:
    """None when an engine's exit code (its core process's, or ``close_and_judge``'s) says it
    stopped and drained, else why not, in one line."""
    if code == EXIT_OK:
        return None
    if code == EXIT_DRAIN_INCOMPLETE:
        return "the engine's KV drain was incomplete (the log above says what was lost)"
    if code is None:
        return "the engine core did not exit"
    if code < 0:
        return f"the engine core was killed by signal {-code}: its KV offload was not drained"
    return f"the engine stopped with code {code}: its KV offload may not have drained"
