"""Compile the C shims with the system C compiler into a directory; read back what they recorded."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
CUDA_INCLUDE = Path("/usr/local/cuda/include")
OPS = {1: "record", 2: "wait", 3: "batch", 4: "copy", 5: "sync", 6: "stream", 7: "register", 8: "unregister"}


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def has_cuda_h() -> bool:
    return (CUDA_INCLUDE / "cuda.h").is_file() and (CUDA_INCLUDE / "cudaTypedefs.h").is_file()


def build(name: str, out_dir: Path) -> Path:
    """Compile tests/shims/<name>.c into <out_dir>/lib<name>.so. fake_cuda is checked against cuda.h when present."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    out = Path(out_dir) / f"lib{name}.so"
    cmd = [cc, "-O2", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{HERE}", str(HERE / f"{name}.c"), "-o", str(out)]
    if name == "fake_cuda" and has_cuda_h():
        cmd[1:1] = ["-DSHIM_WITH_CUDA_H", f"-I{CUDA_INCLUDE}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


class ShimState:
    """ctypes view of a loaded shim's controls and records (the globals of shim_common.h)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def _long(self, name: str) -> ctypes.c_long:
        return ctypes.c_long.in_dll(self.lib, name)

    def _int(self, name: str) -> ctypes.c_int:
        return ctypes.c_int.in_dll(self.lib, name)

    def reset(self) -> None:
        self.lib.shim_reset()

    def set(self, **values: int) -> None:
        """Set controls: version, version_fails, fail_at, fail_code, max_count, max_count_code, reject_attrs_code,
        register_fail_at, register_fail_code, null_batch (fake_cuda only)."""
        ints = {"fail_code", "max_count_code", "reject_attrs_code", "register_fail_code", "version_fails", "null_batch"}
        for k, v in values.items():
            (self._int if k in ints else self._long)(f"shim_{k}").value = v

    @property
    def counts(self) -> list[int]:
        n = self._long("shim_ncalls").value
        return list((ctypes.c_size_t * n).in_dll(self.lib, "shim_call_count"))

    @property
    def num_attrs(self) -> list[int]:
        n = self._long("shim_ncalls").value
        return list((ctypes.c_size_t * n).in_dll(self.lib, "shim_call_num_attrs"))

    @property
    def has_fail_idx(self) -> list[int]:
        n = self._long("shim_ncalls").value
        return list((ctypes.c_int * n).in_dll(self.lib, "shim_call_has_fail_idx"))

    def attrs(self, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """Every attribute record passed (as ``dtype``) and its attrsIdxs entry, in call order."""
        n = self._long("shim_nattrs").value
        raw = bytes((ctypes.c_ubyte * (24 * n)).in_dll(self.lib, "shim_attrs"))
        idx = np.array((ctypes.c_size_t * n).in_dll(self.lib, "shim_attr_idx"), dtype=np.uint64)
        return np.frombuffer(raw, dtype=dtype), idx

    @property
    def log(self) -> list[tuple[str, int, int]]:
        n = self._long("shim_nlog").value
        flat = list((ctypes.c_long * (3 * n)).in_dll(self.lib, "shim_log"))
        return [(OPS[flat[3 * i]], flat[3 * i + 1], flat[3 * i + 2]) for i in range(n)]

    @property
    def streams(self) -> list[int]:
        """The streams created since the last reset, oldest first (an executor makes its copy stream when built)."""
        return [a for op, a, _ in self.log if op == "stream"]

    @property
    def registered(self) -> int:
        return self._long("shim_registered").value
