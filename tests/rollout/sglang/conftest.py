"""Fixtures of the rollout tests: fake SGLang servers in background threads and engines attached to them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from megatron_gspo.rollout.sglang import SGLangConfig, SGLangEngine
from tests.rollout.sglang.fake_server import FakeSGLang


@pytest.fixture
def fake_servers() -> Iterator[Callable[..., list[FakeSGLang]]]:
    """fake_servers(n, **kwargs) -> n started fake servers, stopped at teardown."""
    started: list[FakeSGLang] = []

    def make(n: int = 1, **kwargs) -> list[FakeSGLang]:
        servers = [FakeSGLang(**kwargs).start() for _ in range(n)]
        started.extend(servers)
        return servers

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def attach() -> Iterator[Callable[..., SGLangEngine]]:
    """attach(servers, exporter=None, group_factory=None, resumed=False, **config) -> attach-mode engine (fast
    retries), closed at teardown."""
    engines: list[SGLangEngine] = []

    def make(
        servers: list[FakeSGLang], exporter=None, group_factory=None, resumed=False, **overrides
    ) -> SGLangEngine:
        urls = [s.url for s in servers]
        fields = dict(mode="attach", urls=urls, backoff_s=0.01, max_retries=2, request_timeout_s=10)
        fields.update(overrides)
        kwargs: dict = {"resumed": resumed}
        if group_factory is not None:
            kwargs["group_factory"] = group_factory
        engine = SGLangEngine(SGLangConfig(**fields), exporter, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
