"""The driver's set-up of the engine's GPU on a thread beside the spawned core's imports
(`ember.engine.cuda_context`): which device, which calls, and nothing when there is no driver."""

from __future__ import annotations

import ctypes
import os

import pytest

from ember.engine import cuda_context


@pytest.mark.parametrize(
    ("device", "ordinal"),
    [("cuda", 0), ("cuda:0", 0), ("cuda:3", 3), ("cpu", None), ("cuda:x", None), ("mps", None)],
)
def test_the_device_named_is_the_one_set_up(device: str, ordinal: int | None) -> None:
    assert cuda_context.device_ordinal(device) == ordinal


class _FakeDriver:
    """libcuda's three calls, recorded; `fail` names one that returns an error."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple[str, object]] = []
        self.fail = fail

    def _call(self, name: str, arg: object) -> int:
        self.calls.append((name, arg))
        return 100 if name == self.fail else 0

    def cuInit(self, flags: int) -> int:  # noqa: N802 - the driver's names
        return self._call("cuInit", flags)

    def cuDeviceGet(self, dev: object, ordinal: int) -> int:  # noqa: N802
        return self._call("cuDeviceGet", ordinal)

    def cuDevicePrimaryCtxRetain(self, ctx: object, dev: object) -> int:  # noqa: N802
        return self._call("cuDevicePrimaryCtxRetain", None)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module as in a new process: no thread started, CUDA_MODULE_LOADING unset."""
    monkeypatch.setattr(cuda_context, "_thread", None)
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)


def test_the_primary_context_of_the_device_is_retained_on_a_thread(
    fresh, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = _FakeDriver()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver)
    cuda_context.start("cuda:2")
    assert cuda_context._thread is not None and cuda_context._thread.name == "cuda-context"
    cuda_context.wait()
    assert driver.calls == [
        ("cuInit", 0),
        ("cuDeviceGet", 2),
        ("cuDevicePrimaryCtxRetain", None),
    ]
    # Read by the driver at cuInit: torch's own choice, set before it.
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"
    started = cuda_context._thread
    cuda_context.start("cuda:2")  # once a process
    assert cuda_context._thread is started and len(driver.calls) == 3


def test_a_failing_driver_call_stops_the_set_up_quietly(
    fresh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left for torch to meet and report: no context is asked for a device the driver did not
    give, and nothing raises on the thread."""
    driver = _FakeDriver(fail="cuDeviceGet")
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver)
    cuda_context.start("cuda:7")
    cuda_context.wait()
    assert [name for name, _ in driver.calls] == ["cuInit", "cuDeviceGet"]


def test_no_driver_and_no_cuda_device_start_nothing_that_fails(
    fresh, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda_context.start("cpu")
    assert cuda_context._thread is None and "CUDA_MODULE_LOADING" not in os.environ
    cuda_context.wait()  # at once

    def no_driver(name: str) -> object:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    cuda_context.start("cuda")
    cuda_context.wait()
    assert cuda_context._thread is not None and not cuda_context._thread.is_alive()
