"""The offload worker on a real NVIDIA GPU: CUDA tensors, pinned host tier, copy streams (skipped without one)."""
from __future__ import annotations

import pytest

from kvxfer.offload import HostTier, create_worker, device_from_tensors

pytestmark = pytest.mark.gpu


def test_store_then_load_with_per_layer_stream_waits():
    import torch

    layers = {f"l{i}": torch.randint(0, 255, (64, 16, 128), dtype=torch.uint8, device="cuda") for i in range(4)}
    before = {k: t.clone() for k, t in layers.items()}
    w = create_worker(device_from_tensors(layers), HostTier(num_chunks=32, blocks_per_chunk=2), {"kind": "cuda-batch"})
    compute = torch.cuda.current_stream()
    assert w.submit_store(1, list(range(8)), [3, 4, 5, 6], stream=compute)
    assert w.submit_load(2, [3, 4, 5, 6], list(range(32, 40)), stream=compute)  # ordered after the store it reads
    consumer = torch.cuda.Stream()
    for layer in range(4):
        w.stream_wait_for_layer(2, layer, consumer)
    w.wait_for_layer(2, 3)
    w.wait([1, 2])
    res = w.get_finished()
    assert [r.job_id for r in res] == [1, 2] and all(r.success for r in res), res
    torch.cuda.synchronize()
    for k, t in layers.items():
        assert torch.equal(t[32:40], before[k][0:8]) and torch.equal(t[:32], before[k][:32]), k
    w.shutdown()
