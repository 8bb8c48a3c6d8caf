"""Fixtures for the observability tests: one in-process traced server + gateway on a tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from obs_stack import ObsStack, write_tiny_model


@pytest.fixture(autouse=True, scope="package")
def one_torch_thread():
    """One intra-op thread for the tiny model (restored afterwards).

    Its ops are far too small to gain from a second thread, and on a busy
    machine OpenMP's barriers make two threads many times slower than one.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_obs_model(tmp_path_factory) -> object:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-obs-model"))


@pytest.fixture(scope="session")
def obs(tiny_obs_model) -> Iterator[ObsStack]:
    """Server (auth on) + gateway + engine in this process, sharing a tracer provider and a registry."""
    stack = ObsStack(tiny_obs_model)
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture
def spans(obs: ObsStack):
    """The exporter, cleared before the test so it holds only this test's spans."""
    obs.exporter.clear()
    return obs.exporter
