"""A store's identity follows what the bytes mean: the model's content (not its path), and, for the replicated
single-copy layout (MLA), no parallel sizes; stores keyed on the model's path by earlier releases stay usable.

The fingerprint tests run everywhere; the tier tests need vLLM's classes (``make test-vllm``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvxfer.offload.files.chunk_store import ChunkStore, namespace
from kvxfer.offload.files.identity import SAMPLE_BYTES, model_fingerprint
from tests.test_vllm_tier_events import ROW, _drain, _job, _key, _spec, _tier, needs_vllm


def _model(folder: Path, seed: int = 0, config: dict | None = None) -> Path:
    """A model folder: config.json and a safetensors file of 1 MiB of seeded weights."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or {"hidden_size": 64, "num_hidden_layers": 2}))
    weights = np.random.default_rng(seed).standard_normal(1 << 18).astype(np.float32)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 18], "data_offsets": [0, weights.nbytes]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + weights.tobytes())
    return folder


def test_a_moved_model_folder_keeps_its_fingerprint_and_another_model_does_not(tmp_path):
    first = model_fingerprint(str(_model(tmp_path / "a")))
    assert first.startswith("sha256:") and len(first) == 7 + 32
    shutil.move(tmp_path / "a", tmp_path / "moved")
    assert model_fingerprint(str(tmp_path / "moved")) == first
    assert model_fingerprint(str(_model(tmp_path / "other", seed=1))) != first  # other weights, same shapes
    assert model_fingerprint(str(_model(tmp_path / "cfg", config={"hidden_size": 65}))) != first
    tuned = _model(tmp_path / "tuned")
    with open(tuned / "model.safetensors", "r+b") as f:  # one sample's bytes changed, deep in the file
        f.seek(8 * SAMPLE_BYTES + 100)
        f.write(b"\x01\x02\x03\x04")
    assert model_fingerprint(str(tuned)) != first
    assert model_fingerprint("org/hub-model") == "org/hub-model"  # a hub id does not move


@needs_vllm
def test_chunks_are_found_after_the_model_folder_moved_and_never_by_another_model(tmp_path):
    rows = np.random.default_rng(2).integers(-128, 127, (8, ROW), dtype=np.int8)
    store = tmp_path / "store"
    store.mkdir()
    model = _model(tmp_path / "models" / "m")
    tier = _tier(store, rows, _spec(model=str(model)))
    tier.submit_store(_job(1, [_key(1)], [0]))
    assert all(r.success for r in _drain(tier))
    tier.shutdown()
    shutil.move(model, tmp_path / "elsewhere")
    ctx = _job(0, [], []).req_context
    tier = _tier(store, rows, _spec(model=str(tmp_path / "elsewhere")))
    try:
        assert tier.lookup(_key(1), ctx).name == "HIT"
        tier.submit_load(_job(2, [_key(1)], [5], promotion=True))
        assert all(r.success for r in _drain(tier)) and np.array_equal(rows[5], rows[0])
    finally:
        tier.shutdown()
    other = _model(tmp_path / "models" / "m", seed=3)  # another model at the first path
    tier = _tier(store, rows, _spec(model=str(other)))
    try:
        assert tier.lookup(_key(1), ctx).name == "MISS"
    finally:
        tier.shutdown()


@needs_vllm
def test_a_store_keyed_on_the_model_path_stays_in_use_until_the_content_at_that_path_changes(tmp_path):
    from kvxfer.offload.vllm.tiering import tier_identity

    rows = np.random.default_rng(4).integers(-128, 127, (8, ROW), dtype=np.int8)
    root = tmp_path / "store"
    root.mkdir()
    model = _model(tmp_path / "m")
    spec = _spec(model=str(model))
    legacy = tier_identity(spec, ROW, "0.32.0", legacy=True)
    assert legacy["model"] == str(model) and tier_identity(spec, ROW, "0.32.0")["model"] != str(model)
    old = ChunkStore({"root_dir": str(root), "capacity_bytes": 4 * ROW}, rows, ROW, legacy)  # as earlier releases
    old.submit_store(1, [_key(1)], [0])
    old.drain()
    old.poll()
    old.close()
    ctx = _job(0, [], []).req_context
    tier = _tier(root, rows, spec)
    try:
        assert tier.lookup(_key(1), ctx).name == "HIT" and tier.store.folder.name == namespace(legacy)
    finally:
        tier.shutdown()
    shutil.rmtree(model)
    _model(tmp_path / "m", seed=5)  # other weights at the same path: the old store is not theirs
    tier = _tier(root, rows, _spec(model=str(model)))
    try:
        assert tier.lookup(_key(1), ctx).name == "MISS" and tier.store.folder.name != namespace(legacy)
    finally:
        tier.shutdown()


@needs_vllm
@pytest.mark.parametrize("replicated", [True, False])
def test_replicated_chunks_stored_at_one_tp_size_load_at_another(tmp_path, replicated):
    """MLA at TP: every rank holds the same bytes (vLLM's replicated single-copy layout), so TP=2's chunks serve
    TP=4; a layout whose ranks hold different bytes keeps its TP size in the identity and misses."""
    writer_rows = np.random.default_rng(6).integers(-128, 127, (8, ROW), dtype=np.int8)
    tier = _tier(tmp_path, writer_rows, _spec(tp=2, replicated=replicated))
    tier.submit_store(_job(1, [_key(7)], [0]))
    assert all(r.success for r in _drain(tier))
    tier.shutdown()
    reader_rows = np.zeros((8, ROW), np.int8)
    tier = _tier(tmp_path, reader_rows, _spec(tp=4, rank=3, replicated=replicated))
    try:
        hit = tier.lookup(_key(7), _job(0, [], []).req_context).name == "HIT"
        assert hit == replicated
        if replicated:
            tier.submit_load(_job(2, [_key(7)], [1], promotion=True))
            assert all(r.success for r in _drain(tier)) and np.array_equal(reader_rows[1], writer_rows[0])
    finally:
        tier.shutdown()
