"""The configuration reference (docs/reference/configuration.md) is generated from the code and current: a key added,
a default or a limit changed in a model, and this test fails until the page is rewritten."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "reference"))
import configuration


def test_the_configuration_page_is_current():
    assert configuration.PAGE.read_text() == configuration.render(), "run: python tests/reference/configuration.py"


def test_every_key_of_every_model_has_a_row_with_a_real_error():
    from kvxfer.executors.config import ExecutorConfig
    from kvxfer.offload.files.chunk_store import StoreConfig
    from kvxfer.offload.vllm.checks import KVXFER_KEYS

    text = configuration.render()
    for name in StoreConfig.model_fields:
        assert f"| `{name}` |" in text
    for name in ExecutorConfig.model_fields:
        assert f"| `{name}" in text
    for key in KVXFER_KEYS:
        assert f"| `{key}` |" in text
    assert "(accepted)" not in text  # every bad value shown is refused
    assert "| `lock_timeout_s` | float | `5.0` | seconds |" in text


def test_a_changed_default_makes_the_page_stale(monkeypatch: pytest.MonkeyPatch):
    from kvxfer.offload.files.chunk_store import StoreConfig

    field = StoreConfig.model_fields["lock_timeout_s"]
    monkeypatch.setattr(field, "default", 7.5)
    assert configuration.PAGE.read_text() != configuration.render()
