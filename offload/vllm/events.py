"""KV-cache events of kvxfer's storage tier, the way vLLM's own tiers report theirs (``TierEvents``).

vLLM publishes where a prefix's KV cache lives (``BlockStored`` / ``BlockRemoved``, read by KV-aware routers)
from the ``OffloadingEvent``s its tiers hand over in ``take_events``. A secondary tier opts in with
``enable_kv_events`` in its ``secondary_tiers`` entry, and only counts when the engine publishes events at all
(``kv_events_config``); otherwise it keeps nothing (nothing drains the list). kvxfer's tier reports:

- stored: the keys of a store job once it is durable (never a job that failed, never keys a job skipped),
  and, once when the store opens, the chunks it found on disk (a warm restart: a router learns them too);
- removed: keys that left the store: evicted to make room, or dropped because a load refused them (torn,
  stale, corrupted).

Each event names the medium (storage), the tier's ``locality`` and its ownership (the tier's type), and says a
removal will follow (vLLM keeps the stored payload until then). Pure: the event class is passed in, so this
module imports no vLLM.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..files.chunk_store import StoreConfigError

__all__ = ["TierEvents", "events_wanted"]

_log = logging.getLogger("kvxfer.offload.vllm.tiers")


def events_wanted(spec: Any, requested: Any, tier_type: str) -> bool:
    """Whether a tier asked for events (``enable_kv_events``, a bool) emits them: only when the engine publishes
    KV-cache events (``spec.kv_events_config.enable_kv_cache_events``); asked without it: a warning, and none.
    A value other than a bool raises StoreConfigError naming the key as the tier's config spells it."""
    if not isinstance(requested, bool):
        raise StoreConfigError(f"secondary_tiers[{tier_type}].enable_kv_events", requested, "must be true or false")
    if not requested:
        return False
    config = getattr(spec, "kv_events_config", None)
    if config is not None and bool(getattr(config, "enable_kv_cache_events", False)):
        return True
    _log.warning("kvxfer: enable_kv_events is set on secondary tier %r but the engine publishes no KV cache events "
                 "(kv_events_config): the tier emits none", tier_type)
    return False


class TierEvents:
    """The events a tier has to hand over: ``stored``/``removed`` append one event (no event for no keys),
    ``take`` returns them in order and empties the list. ``make`` builds one event from the keywords ``keys``,
    ``medium``, ``removed``, ``locality``, ``ownership`` and ``removal_expected`` (vLLM's ``OffloadingEvent``).

    Threading: one thread (vLLM's scheduler thread, which owns the tier) calls every method."""

    def __init__(self, make: Callable[..., Any], medium: Any, locality: Any, ownership: str):
        self._make, self._medium, self._locality, self._ownership = make, medium, locality, ownership
        self._events: list[Any] = []

    def stored(self, keys: Sequence[bytes]) -> None:
        """Report ``keys`` stored (their order kept)."""
        self._add(keys, removed=False)

    def removed(self, keys: Sequence[bytes]) -> None:
        """Report ``keys`` gone from the store."""
        self._add(keys, removed=True)

    def take(self) -> list[Any]:
        """The events since the last call, oldest first."""
        out, self._events = self._events, []
        return out

    def _add(self, keys: Sequence[bytes], *, removed: bool) -> None:
        if keys:
            self._events.append(self._make(keys=list(keys), medium=self._medium, removed=removed,
                                           locality=self._locality, ownership=self._ownership, removal_expected=True))
