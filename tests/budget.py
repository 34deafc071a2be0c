"""Hypothesis example budgets per profile, chosen with ``HYPOTHESIS_PROFILE`` (dev, the default; ci; long).

``EXAMPLES[profile]`` is every property's default; ``MERGED_EXAMPLES`` is the budget of the merged-equals-
per-piece property alone (at least 10,000 in CI). CI time per test file is kept in benchmarks/NOTES.md.
"""
from __future__ import annotations

import os

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")
EXAMPLES = {"dev": 200, "ci": 1500, "long": 20000}
_MERGED = {"dev": 300, "ci": 10000, "long": 50000}
if PROFILE not in EXAMPLES:
    raise ValueError(f"HYPOTHESIS_PROFILE = {PROFILE!r}: expected one of {sorted(EXAMPLES)}")
MERGED_EXAMPLES = _MERGED[PROFILE]
