"""Fixtures shared by the unit tests."""

import pytest


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """Tiny random checkpoints of every engine architecture and the MTP assistant
    (``tests/helpers/checkpoints.py: build_engine_set``), built once per session: the engine
    tests only read them. A module needing other checkpoints defines its own ``ckpts``."""
    from tests.helpers.checkpoints import build_engine_set

    return build_engine_set(tmp_path_factory.mktemp("engine_set"))


# The front tests' clients. Each front test module defines its own ``stack``
# (tests/unit/front_harness.py: start_stack with that module's options); these talk to it.
@pytest.fixture(scope="module")
def client(stack):
    import openai

    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def http(stack):
    import httpx

    with httpx.Client(base_url=stack.base_url, timeout=20) as c:
        yield c
