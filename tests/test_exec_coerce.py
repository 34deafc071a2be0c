"""One coercion of an executor argument (``kvxfer.executors.coerce_executor``): every form the offload worker, its
builder and the simple path accept, told apart by class, to an executor and whether the caller owns it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvxfer.executors import (
    BACKENDS,
    AutoExecutor,
    CompletedTransfer,
    ConfigError,
    Executor,
    ExecutorConfig,
    ExecutorKind,
    ExecutorSource,
    NumpyExecutor,
    PlanRunner,
    coerce_executor,
)
from kvxfer.executors import NumpyExecutor as RealNumpy
from kvxfer.planner import Target


class Wrapper:
    """A plain object in front of an executor (not an Executor subclass), with the interface PlanRunner declares."""

    synchronous = True

    def __init__(self) -> None:
        self.inner = NumpyExecutor()

    @property
    def target(self) -> Target:
        return self.inner.target

    def bind(self, buffers: Any, bindings: Any) -> Any:
        return self.inner.bind(buffers, bindings)

    def run(self, plan: Any, memory: Any, stream: Any = None, after: Any = None) -> Any:
        return CompletedTransfer(nbytes=0, ranges=0, calls=0)

    def close(self) -> None:
        self.inner.close()


class Subclass(NumpyExecutor):
    """A registered backend's subclass: its kind is its base's."""


def _forms(tmp_path: Path) -> dict[str, Any]:
    toml = tmp_path / "numpy.toml"
    toml.write_text('kind = "numpy"\n')
    js = tmp_path / "numpy.json"
    js.write_text(json.dumps({"kind": "numpy"}))
    return {
        "instance": NumpyExecutor(), "wrapper instance": Wrapper(), "subclass instance": Subclass(),
        "class": NumpyExecutor, "function": lambda: NumpyExecutor(), "config": ExecutorConfig(kind="numpy"),
        "dict": {"kind": "numpy"}, "str path": str(toml), "PathLike": js, "None": None,
    }


FORMS = ["instance", "wrapper instance", "subclass instance", "class", "function", "config", "dict", "str path",
         "PathLike", "None"]


@pytest.mark.parametrize("form", FORMS)
def test_every_form_the_worker_takes_gives_an_executor_and_whether_the_caller_owns_it(form, tmp_path, monkeypatch):
    monkeypatch.delenv("KVXFER_EXECUTOR_CONFIG", raising=False)
    monkeypatch.delenv("KVXFER_EXECUTOR", raising=False)
    value = _forms(tmp_path)[form]
    source = coerce_executor(value)
    assert isinstance(source, ExecutorSource) and coerce_executor(source) is source  # a source passes through
    (a, owned_a), (b, owned_b) = source.make(one_kind=True), source.make(one_kind=True)
    assert isinstance(a, PlanRunner) and isinstance(b, PlanRunner)
    given = form.endswith("instance")
    assert (owned_a, owned_b) == (not given, not given)
    assert (a is b) == given and (a is value) == given  # the caller's executor is used as is, never made again
    if form == "None":  # the default config: auto, made as the kind this platform runs for one_kind
        assert not isinstance(a, AutoExecutor) and isinstance(source.make()[0], AutoExecutor)
    for ex, owned in ((a, owned_a), (b, owned_b)):
        if owned:
            ex.close()


@pytest.mark.parametrize("form,kind", [("instance", ExecutorKind.NUMPY), ("subclass instance", ExecutorKind.NUMPY),
                                       ("config", ExecutorKind.NUMPY), ("dict", ExecutorKind.NUMPY),
                                       ("str path", ExecutorKind.NUMPY), ("PathLike", ExecutorKind.NUMPY),
                                       ("wrapper instance", None), ("class", None), ("function", None)])
def test_the_backend_is_known_without_making_an_executor_except_for_factories_and_wrappers(form, kind, tmp_path):
    source = coerce_executor(_forms(tmp_path)[form])
    assert (source.backend.kind if source.backend else None) == kind


def test_auto_names_the_backend_this_platform_runs(monkeypatch):
    monkeypatch.delenv("KVXFER_EXECUTOR", raising=False)
    source = coerce_executor({"kind": "auto"})
    assert source.backend is not None and source.backend.kind is not ExecutorKind.AUTO
    assert source.backend is BACKENDS[source.backend.kind]


def test_kinds_are_matched_by_class_not_by_class_name():
    """An executor of an unrelated class that only shares a registered backend's class name is not that backend."""

    class NumpyExecutor(Executor):  # the impostor: a registered class name, another class
        synchronous = True

    assert coerce_executor(NumpyExecutor()).backend is None
    assert coerce_executor(RealNumpy()).backend is BACKENDS[ExecutorKind.NUMPY]


@pytest.mark.parametrize("value", [42, 2.5, object(), [NumpyExecutor()], b"numpy.toml"])
def test_any_other_form_is_refused_naming_the_value(value):
    with pytest.raises(ConfigError) as e:
        coerce_executor(value)
    assert e.value.field == "executor" and e.value.value is value
    assert type(value).__name__ in str(e.value) and "zero-argument factory" in str(e.value)


def test_a_bad_config_is_refused_when_coerced_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError) as e:
        coerce_executor({"kind": "warp-drive"})
    assert e.value.field == "kind"
    with pytest.raises(ConfigError) as e:
        coerce_executor(tmp_path / "missing.toml")
    assert "no such file" in str(e.value)


def test_a_factory_is_called_once_per_executor_made():
    made: list[NumpyExecutor] = []

    def factory() -> NumpyExecutor:
        made.append(NumpyExecutor())
        return made[-1]

    source = coerce_executor(factory)
    assert made == [] and source.backend is None  # nothing is made to answer which backend
    first, second = source.make()[0], source.make()[0]
    assert made == [first, second] and first is not second
