"""What a model's bytes are, read from its folder (``model_fingerprint``), and which store namespace to open
(``choose_identity``): a store's identity follows the model's content, not the path it was loaded from.

A model folder is fingerprinted from its ``config.json`` (the bytes, whole) and its weight files
(``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``), each by relative name, size, its leading header
(for safetensors: every tensor's name, dtype, shape and offsets) and 16 samples of 64 KiB spread evenly over it.
Moving or copying the folder keeps the fingerprint; other weights (another fine-tune of the same architecture
differs in every sample) or another config change it. Reading costs about 1 MiB per weight file, whatever its
size (a few milliseconds per file from the page cache). A name that is not a local folder (a hub id) is kept as
it is: such a name does not move.

Stores written before identities followed content were keyed on the model's path. ``choose_identity`` keeps
using such a store, in place, while the model stays at that path and its content is the one first seen there
(recorded beside it in ``model.json`` on first use); otherwise the content-keyed namespace is used.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvxfer.executors import file_trust

__all__ = ["SAMPLE_BYTES", "SAMPLES", "WEIGHT_SUFFIXES", "choose_identity", "model_fingerprint"]

_log = logging.getLogger(__name__)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES = 16
SAMPLE_BYTES = 64 << 10
HEADER_LIMIT = 100 << 20  # a safetensors header longer than this is read as a plain sample
MODEL_FILE = "model.json"


def model_fingerprint(name: str) -> str:
    """``"sha256:<32 hex digits>"`` of the model folder ``name`` (see the module docstring), or ``name`` itself
    when it is not a local folder with a ``config.json``. OSError when a file of the folder cannot be read."""
    folder = Path(name)
    if not (folder / "config.json").is_file():
        return name
    h = hashlib.sha256()
    h.update(b"config\0" + (folder / "config.json").read_bytes())
    weights = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    for path in weights:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(f"\0{path.relative_to(folder).as_posix()}\0{size}\0".encode())
            head = f.read(8)
            h.update(head)
            if path.suffix == ".safetensors" and len(head) == 8:
                n = int.from_bytes(head, "little")
                if n <= min(HEADER_LIMIT, size - 8):
                    h.update(f.read(n))
            step = max(size // SAMPLES, 1)
            for at in range(0, size, step)[:SAMPLES]:
                h.update(os.pread(f.fileno(), SAMPLE_BYTES, at))
    return f"sha256:{h.hexdigest()[:32]}"


def choose_identity(root: str | os.PathLike[str], identity: Mapping[str, Any], legacy: Mapping[str, Any] | None,
                    namespace: Callable[[Mapping[str, Any]], str]) -> Mapping[str, Any]:
    """The identity to open under ``root``: ``identity`` (content-keyed), unless its namespace does not exist yet
    and ``legacy`` (the path-keyed identity of earlier releases) names a store there whose recorded content is
    this model's (``model.json``, written on first use). ``namespace`` maps an identity to its folder name."""
    if legacy is None or legacy == identity or (Path(root) / namespace(identity)).exists():
        return identity
    folder = Path(root) / namespace(legacy)
    if not (folder / "identity.json").is_file() or folder.is_symlink():
        return identity
    content = {"model": identity.get("model")}
    record = folder / MODEL_FILE
    try:
        fd, created = file_trust.open_file(record, os.O_RDWR, create=True)
    except OSError as e:
        _log.warning("kvxfer file tier: %s: cannot open (%s); the store written under the model's path is left "
                     "unused", record, e.strerror)
        return identity
    try:
        if created:
            os.write(fd, json.dumps(content, sort_keys=True).encode())
            os.fsync(fd)
        elif file_trust.untrusted(os.fstat(fd)) is not None or os.pread(fd, 1 << 16, 0).decode(errors="replace") != \
                json.dumps(content, sort_keys=True):
            _log.info("kvxfer file tier: %s holds another model's chunks (its content changed since): a new store "
                      "is used", folder)
            return identity
    finally:
        os.close(fd)
    _log.info("kvxfer file tier: using %s, written under the model's path by an earlier release", folder)
    return legacy
