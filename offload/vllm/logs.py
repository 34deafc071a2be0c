"""kvxfer's log lines in the engine's log.

vLLM configures its own ``vllm`` logger (a handler and a level, ``VLLM_LOGGING_LEVEL``) and no other: kvxfer's
``kvxfer.*`` loggers have no handler there, so their INFO lines (the start-up line saying kvxfer is active and with
what config, the file tier's folder and chunks found) went nowhere, and only warnings reached stderr through
Python's last-resort handler, unformatted. ``log_through_vllm`` gives kvxfer's logger vLLM's handlers and level,
so kvxfer's lines appear among vLLM's, in its format. Imports no vLLM (``api`` calls it once vLLM is imported).
"""
from __future__ import annotations

import logging

__all__ = ["config_summary", "log_through_vllm"]


def log_through_vllm(engine_logger: str = "vllm", ours: str = "kvxfer") -> bool:
    """Route logger ``ours`` (and its children) through the handlers and level of ``engine_logger``. Leaves
    everything as it is, returning False, when the engine's logger has no handler (``VLLM_CONFIGURE_LOGGING=0``:
    the user's own logging config applies) or when ``ours`` already has handlers (configured by the user, or by an
    earlier call); True when it routed."""
    engine, kv = logging.getLogger(engine_logger), logging.getLogger(ours)
    if not engine.handlers or kv.handlers:
        return False
    for handler in engine.handlers:
        kv.addHandler(handler)
    if kv.level == logging.NOTSET:
        kv.setLevel(engine.level or logging.INFO)
    kv.propagate = False  # the engine's logger does not propagate either: each line is written once
    return True


# the keys of kv_connector_extra_config the start-up line repeats (the host tier's size and kvxfer's own)
_SHOWN = ("cpu_bytes_to_use", "blocks_per_chunk", "block_size")


def config_summary(extra: dict[str, object]) -> str:
    """The start-up line's account of the config: the host tier's sizing keys and every ``kvxfer_*`` key given, as
    ``key=value`` pairs in the config's order ("defaults" when none is given)."""
    shown = [f"{k}={v!r}" for k, v in extra.items() if k in _SHOWN or k.startswith("kvxfer_")]
    return ", ".join(shown) or "defaults"
