"""The bundled tiny-shakespeare pair: served by `tandem serve` with no model flags (MTP on),
lossless against MTP off (the target served by a Hub id from an offline cache) and HF transformers, with acceptance >= 2.5 at S = 3 on held-out
prompts, read from the server's own /server_info and /metrics. (A test of the fixed artifact.)"""

from __future__ import annotations

import os

import httpx
import pytest
from openai import OpenAI

from tests.helpers.checkpoints import hf_greedy
from tests.helpers.hub_cache import add_to_cache
from tests.helpers.server import ROOT, Server

pytestmark = pytest.mark.heavy  # minutes of work: started first (tests/conftest.py)

PAIR = os.path.join(ROOT, "models", "tiny-shakespeare")
PROMPTS_FILE = os.path.join(ROOT, "benchmarks", "prompts_shakespeare_heldout.txt")


def _prompts(n: int) -> list[str]:
    with open(PROMPTS_FILE) as f:
        lines = [ln.rstrip("\n").replace("\\n", "\n") for ln in f if ln.strip()]
    return lines[:: max(1, len(lines) // n)][:n]


def _complete(srv, prompts, n_tokens=48, model="tiny-shakespeare"):
    client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
    return [client.completions.create(model=model, prompt=p, max_tokens=n_tokens, temperature=0)
            for p in prompts]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    prompts = _prompts(8)
    # As `tandem serve` runs by default: MTP on (S = 3), decode steps compiled (the first run on a
    # machine builds them: minutes on two cores, hence the timeout).
    with Server(None, compiled=True, timeout=900) as srv:
        mtp = _complete(srv, prompts)
        info = httpx.get(srv.url + "/server_info").json()
        metrics = httpx.get(srv.url + "/metrics").text
        assert "compiled CPU steps off" not in srv.output()
    # The target alone, named by a Hub id served from a pre-populated cache with no network
    # (`tandem serve ORG/NAME` as a vLLM user types it), decoding eagerly: the reference the
    # compiled MTP steps must equal. (The compiled plain steps have their own lossless test:
    # tests/unit/gpu_worker/spec/test_engine_mtp.py, draft "none", and tests/e2e/test_llm.py.)
    hf_home = str(tmp_path_factory.mktemp("hf_home"))
    add_to_cache(hf_home, "tandem-test/tiny-shakespeare", os.path.join(PAIR, "target"))
    with Server(None, "tandem-test/tiny-shakespeare", env={"HF_HOME": hf_home, "HF_HUB_OFFLINE": "1"}) as srv:
        served = [m.id for m in OpenAI(base_url=srv.base_url, api_key="none").models.list().data]
        assert served == ["tandem-test/tiny-shakespeare"]
        plain = _complete(srv, prompts, model=served[0])
    return prompts, mtp, plain, info, metrics


def test_mtp_equals_plain_greedy(outputs):
    prompts, mtp, plain, _, _ = outputs
    for a, b in zip(mtp, plain):
        assert a.choices[0].text == b.choices[0].text
        assert a.usage.completion_tokens == b.usage.completion_tokens


def test_acceptance_on_held_out_prompts(outputs):
    _, _, _, info, metrics = outputs
    assert info["avg_spec_accept_length"] >= 2.5
    assert "tandem:spec_decode_num_drafts_total" in metrics


def test_hf_transformers_agrees(outputs):
    from tokenizers import Tokenizer

    prompts, mtp, _, _, _ = outputs
    target = os.path.join(PAIR, "target")
    tok = Tokenizer.from_file(os.path.join(target, "tokenizer.json"))
    for prompt, r in list(zip(prompts, mtp))[:3]:
        ids = tok.encode(prompt).ids
        ref = hf_greedy(target, ids, 48)
        assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
