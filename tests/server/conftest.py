"""A real `ember serve` on loopback, on the tiny model, shared by the server tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.servers import Server, start_server, wait_healthy  # noqa: F401 - re-exported to tests


@pytest.fixture(scope="session")
def server_factory(tiny_model_dir) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def make(
        *extra: str,
        arch: str = "qwen3",
        api_key: str | None = None,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> Server:
        s = start_server(tiny_model_dir(arch), *extra, api_key=api_key, wait=wait, env=env)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def server(server_factory) -> Server:
    """The default server: tiny Qwen3 (Hermes tool calls), no API key."""
    return server_factory()
