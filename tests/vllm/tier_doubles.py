"""Test-only secondary tiers, loaded by the engine through ``module_path="tests.vllm.tier_doubles"``.

``RecordingFileTier`` records the KV-cache events the file tier hands to vLLM.

``CrashingFileTier`` is kvxfer's file tier whose store number ``crash_at_store`` SIGKILLs the engine process (the
scheduler, where the tier runs) once that store's data is in the file and before its records and index entries
are: an engine killed while stores are in flight, at the worst point, every time. It writes ``crash_marker``
first, so that the runner knows the engine is gone.
"""
from __future__ import annotations

import json
import os
import signal
from typing import Any

from kvxfer.executors import PosixFileExecutor
from kvxfer.offload.vllm import KvxferFileTier


class _KillsAfterData:
    """A POSIX executor whose ``crash_at``-th write run kills the process once its bytes are written."""

    def __init__(self, threads: int, crash_at: int, marker: str):
        self.inner, self.crash_at, self.marker, self.writes = PosixFileExecutor(threads=threads), crash_at, marker, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def run(self, plan: Any, memory: Any, stream: Any = None, after: Any = None) -> Any:
        transfer = self.inner.run(plan, memory)
        if plan.direction.value == "d2h":  # host rows -> file: a store
            self.writes += 1
            if self.writes == self.crash_at:
                transfer.wait()
                with open(self.marker, "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        return transfer


class CrashingFileTier(KvxferFileTier):  # type: ignore[misc, valid-type]
    """KvxferFileTier that kills the engine during its ``crash_at_store``-th store (after the data, before the
    records and index entries)."""

    def __init__(self, *args: Any, crash_at_store: int = 1, crash_marker: str = "", **config: Any):
        self._crash_at, self._marker = int(crash_at_store), crash_marker
        super().__init__(*args, **config)

    def storage_executor(self, settings: Any) -> Any:
        return _KillsAfterData(settings.io_threads or 1, self._crash_at, self._marker)


class RecordingFileTier(KvxferFileTier):  # type: ignore[misc, valid-type]
    """KvxferFileTier that also appends every event it hands to vLLM to ``events_path`` (one JSON line per event:
    hex keys, medium, removed, ownership), so a test reads what a KV-aware router would have been told."""

    def __init__(self, *args: Any, events_path: str = "", **config: Any):
        self._events_path = events_path
        super().__init__(*args, **config)

    def take_events(self) -> list[Any]:
        events = super().take_events()
        if events:
            with open(self._events_path, "a") as f:
                for e in events:
                    f.write(json.dumps({"keys": [bytes(k).hex() for k in e.keys], "medium": e.medium.value,
                                        "removed": e.removed, "ownership": e.ownership,
                                        "locality": None if e.locality is None else e.locality.value}) + "\n")
        return events
