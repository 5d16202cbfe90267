"""Fixtures shared by the unit tests."""

import pytest


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """Tiny random checkpoints of every engine architecture and the MTP assistant
    (``tests/helpers/checkpoints.py: build_engine_set``), built once per session: the engine
    tests only read them. A module needing other checkpoints defines its own ``ckpts``."""
    from tests.helpers.checkpoints import build_engine_set

    return build_engine_set(tmp_path_factory.mktemp("engine_set"))
