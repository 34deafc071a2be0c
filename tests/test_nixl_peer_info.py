"""NIXL peer descriptions are data: ``NixlExecutor.describe`` writes PeerInfo JSON, ``add_peer`` reads it back, and
any malformed blob (truncated, a pickle, wrong types, wrong counts, huge values, unknown keys) is refused with one
PeerInfoError naming the field, before NIXL is given anything. Runs without NIXL (a scripted agent)."""
from __future__ import annotations

import base64
import json
import pickle

import numpy as np
import pytest

from kvxfer.executors import NixlExecutor, PeerInfo, PeerInfoError, RemoteBuffer
from kvxfer.executors.nixl_memory import MAX_PEER_BUFFERS, MAX_PEER_INFO_BYTES, Segment

from .test_nixl_unit import ScriptedAgent


class PeerAgent(ScriptedAgent):
    """A scripted agent that loads metadata naming agent ``metadata`` (its bytes, decoded) and records every call."""

    def __init__(self, name="tier"):
        super().__init__()
        self.name = name
        self.loaded: list[bytes] = []

    def get_agent_metadata(self):
        return f"meta:{self.name}".encode()

    def add_remote_agent(self, metadata):
        self.loaded.append(metadata)
        if not metadata.startswith(b"meta:"):
            raise RuntimeError("nixlInvalidParamError: bad metadata")
        return metadata[5:]

    def remove_remote_agent(self, agent):
        self.log.append(("remove", agent))


def _blob(**edits) -> bytes:
    doc = {"format": "kvxfer.nixl-peer", "version": 1, "agent": "tier",
           "metadata": base64.b64encode(b"meta:tier").decode(),
           "buffers": [["cpu", "DRAM", 1 << 20, 4096, 0], ["gpu", "VRAM", 1 << 30, 8192, 1]]}
    doc.update(edits)
    return json.dumps(doc).encode()


def test_describe_and_add_peer_round_trip_through_json():
    tier = NixlExecutor(agent=PeerAgent("tier"))
    host = np.zeros(4096, np.uint8)
    blob = tier.describe(tier.register({"cpu": host}))
    doc = json.loads(blob)
    assert doc["buffers"] == [["cpu", "DRAM", host.ctypes.data, 4096, 0]] and doc["agent"] == "tier"
    engine = NixlExecutor(agent=PeerAgent("engine"))
    remote = engine.add_peer(blob)
    assert remote == {"cpu": RemoteBuffer("tier", host.ctypes.data, 4096, 0, "DRAM")}
    assert engine.agent.loaded == [b"meta:tier"]
    assert PeerInfo.decode(blob) == PeerInfo("tier", b"meta:tier", (("cpu", Segment(host.ctypes.data, 4096, 0, "DRAM")),))


class Evil:
    def __reduce__(self):
        return (exec, ("raise SystemExit('a peer ran code')",))


BAD = {  # name -> (blob, field named, reason fragment)
    "a pickle of a description": (pickle.dumps(json.loads(_blob())), "blob", "a pickle"),
    "a pickle that runs code": (pickle.dumps(Evil()), "blob", "a pickle"),
    "truncated": (_blob()[:-7], "blob", "not JSON"),
    "empty": (b"", "blob", "not JSON"),
    "not utf-8": (b"\xff\xfe{}", "blob", "not JSON"),
    "a JSON list": (b"[1, 2]", "blob", "expected a JSON object"),
    "NaN": (_blob().replace(b"4096", b"NaN"), "blob", "not JSON"),
    "not bytes": ({"agent": "tier"}, "blob", "expected bytes"),
    "another format": (_blob(format="nixl"), "format", "expected 'kvxfer.nixl-peer'"),
    "a later version": (_blob(version=2), "version", "reads version 1"),
    "a missing key": (json.dumps({"format": "kvxfer.nixl-peer", "version": 1}).encode(), "agent", "missing"),
    "an unknown key": (_blob(extra=1), "extra", "unknown key"),
    "an agent name of the wrong type": (_blob(agent=7), "agent", "non-empty string"),
    "an empty agent name": (_blob(agent=""), "agent", "non-empty string"),
    "metadata not base64": (_blob(metadata="%%%"), "metadata", "not base64"),
    "empty metadata": (_blob(metadata=""), "metadata", "empty"),
    "buffers not a list": (_blob(buffers={"cpu": 1}), "buffers", "expected a list"),
    "more names than descriptors": (_blob(buffers=[["cpu", "DRAM", 4096, 64, 0], ["gpu"]]), "buffers[1]",
                                    "a name and its whole descriptor"),
    "a descriptor with an extra field": (_blob(buffers=[["cpu", "DRAM", 4096, 64, 0, 9]]), "buffers[0]", "whole descriptor"),
    "a name twice": (_blob(buffers=[["cpu", "DRAM", 4096, 64, 0], ["cpu", "DRAM", 8192, 64, 0]]), "buffers[1].name", "twice"),
    "an unknown memory type": (_blob(buffers=[["cpu", "FILE", 4096, 64, 0]]), "buffers[0].mem", "one of"),
    "an address as a string": (_blob(buffers=[["cpu", "DRAM", "4096", 64, 0]]), "buffers[0].addr", "an integer"),
    "a size as a float": (_blob(buffers=[["cpu", "DRAM", 4096, 64.0, 0]]), "buffers[0].nbytes", "an integer"),
    "a size as a bool": (_blob(buffers=[["cpu", "DRAM", 4096, True, 0]]), "buffers[0].nbytes", "an integer"),
    "a negative address": (_blob(buffers=[["cpu", "DRAM", -1, 64, 0]]), "buffers[0].addr", "outside"),
    "a huge address": (_blob(buffers=[["cpu", "DRAM", 1 << 64, 64, 0]]), "buffers[0].addr", "outside"),
    "a zero size": (_blob(buffers=[["cpu", "DRAM", 4096, 0, 0]]), "buffers[0].nbytes", "outside"),
    "a huge size": (_blob(buffers=[["cpu", "DRAM", 4096, 1 << 70, 0]]), "buffers[0].nbytes", "outside"),
    "a segment wrapping the address space": (_blob(buffers=[["cpu", "DRAM", (1 << 64) - 8, 64, 0]]), "buffers[0].nbytes",
                                             "past the 64-bit address space"),
    "a huge device": (_blob(buffers=[["cpu", "VRAM", 4096, 64, 1 << 40]]), "buffers[0].dev", "outside"),
    "an integer of 5000 digits": (_blob().replace(b"4096", b"9" * 5000), "blob", "not JSON"),
    "too many buffers": (_blob(buffers=[[f"b{i}", "DRAM", 4096, 64, 0] for i in range(MAX_PEER_BUFFERS + 1)]),
                         "buffers", "more than"),
    "deeply nested": (_blob(buffers=json.loads("[" * 100 + "]" * 100)), "buffers[0]", "whole descriptor"),
    "too deeply nested to parse": (b'{"agent": ' + b"[" * 200000 + b"]" * 200000 + b"}", "blob", "not JSON"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_malformed_description_is_refused_naming_the_field_and_loads_nothing(name):
    blob, field, reason = BAD[name]
    engine = NixlExecutor(agent=PeerAgent("engine"))
    with pytest.raises(PeerInfoError, match=reason) as e:
        engine.add_peer(blob)
    assert e.value.field == field and str(e.value).startswith(f"peer info {field} = ")
    assert engine.agent.loaded == []


def test_an_oversized_description_is_refused_before_it_is_parsed():
    with pytest.raises(PeerInfoError, match=rf"^peer info blob = '{MAX_PEER_INFO_BYTES + 1} bytes': larger than"):
        PeerInfo.decode(b" " * (MAX_PEER_INFO_BYTES + 1))


def test_metadata_nixl_refuses_or_that_names_another_agent_is_refused_and_unloads_no_agent():
    engine = NixlExecutor(agent=PeerAgent("engine"))
    with pytest.raises(PeerInfoError, match=r"^peer info metadata = '3 bytes': refused by NIXL: RuntimeError: nixlInvalidParamError"):
        engine.add_peer(_blob(metadata=base64.b64encode(b"xyz").decode()))
    engine.add_peer(_blob(agent="other", metadata=base64.b64encode(b"meta:other").decode()))  # a live peer
    with pytest.raises(PeerInfoError, match=r"^peer info agent = 'tier': the NIXL metadata is agent 'other''s; agents "
                                            r"already loaded are left as they are"):
        engine.add_peer(_blob(metadata=base64.b64encode(b"meta:other").decode()))  # its description replayed
    assert not [e for e in engine.agent.log if e[0] == "remove"]  # 'other' stays loaded
