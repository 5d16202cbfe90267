"""Several ``--served-model-name``s: every name is listed and accepted; responses show the first."""

from __future__ import annotations

import openai
import pytest

from tests.unit.front_harness import MODEL, start_stack

ALIASES = ("alias-a", "org/alias-b")


@pytest.fixture(scope="module")
def stack():
    s = start_stack(served_model_aliases=ALIASES)
    yield s
    s.close()


def test_every_name_is_listed_and_retrievable(client):
    assert [m.id for m in client.models.list().data] == [MODEL, *ALIASES]
    for name in (MODEL, *ALIASES):
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("alias")


@pytest.mark.parametrize("name", [MODEL, *ALIASES])
def test_any_name_is_accepted_and_the_first_is_answered(client, name):
    out = client.completions.create(model=name, prompt="Hi", max_tokens=2)
    assert out.model == MODEL
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.model == MODEL


def test_an_unknown_name_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="alias-c", prompt="Hi", max_tokens=2)
    assert exc.value.body["param"] == "model"
