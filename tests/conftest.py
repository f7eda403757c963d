"""Shared fixtures: one model per small preset, built and jitted once per test run (``small_models``)."""

import pytest

from small_models import Built, build


@pytest.fixture(scope="session", params=["tiny", "tiny_linear"])
def small_model(request) -> Built:
    return build(request.param)
