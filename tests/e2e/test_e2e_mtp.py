"""`tandem serve` with frozen-KV MTP: greedy equals HF plain greedy, at the default overlap depth (3),
at depth 2 and without overlap; spec metrics present and consistent; a draft that does not fit the
target fails at start."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI
from tokenizers import Tokenizer

from tests.helpers.checkpoints import build_assistant, hf_greedy
from tests.helpers.server import ROOT, Server

PROMPTS = ["The quick brown fox", "Once upon a time there was", "def serve(model):"]


def _metric(text: str, name: str, labels: str = "") -> float:
    pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})? ([0-9.e+-]+)$", re.M)
    return sum(float(m.group(2)) for m in pat.finditer(text))


def _metrics_and_info(url: str) -> tuple[str, dict]:
    """/metrics and /server_info from one scheduler report. The scheduler may report once more
    after the answer (with overlap, the finished request's step still in flight counts its
    draft when it returns): read again until no report landed between the reads (bounded)."""
    with httpx.Client(timeout=10) as c:
        deadline = time.monotonic() + 10
        while True:
            before = c.get(url + "/server_info").json()["scheduler_stats"]
            text = c.get(url + "/metrics").text
            info = c.get(url + "/server_info").json()
            if info["scheduler_stats"] == before or time.monotonic() > deadline:
                return text, info
            time.sleep(0.05)


@pytest.mark.parametrize("overlap", [[], ["--disable-overlap-schedule"], ["--overlap-depth", "2"]],
                         ids=["overlap-default-depth3", "no-overlap", "depth2"])
def test_mtp_greedy_equals_hf(ckpts, overlap):
    g, a = ckpts["gemma4"], ckpts["assistant"]
    flags = ["--speculative-algorithm", "FROZEN-KV-MTP", "--speculative-draft-model-path", a,
             "--speculative-num-steps", "3"] + overlap
    tok = Tokenizer.from_file(f"{g}/tokenizer.json")
    with Server(g, *flags) as srv:
        client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        for prompt in PROMPTS:
            ref = hf_greedy(g, tok.encode(prompt).ids, 20)
            r = client.completions.create(model=g, prompt=prompt, max_tokens=20, temperature=0)
            assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
            assert r.usage.completion_tokens == len(ref)
        gen = httpx.post(srv.url + "/generate", json={"text": PROMPTS[0], "sampling_params": {
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}).json()
        assert gen["meta_info"]["completion_tokens"] == 12
        assert 1 <= gen["meta_info"]["spec_verify_ct"] <= 12
        m, info = _metrics_and_info(srv.url)
        drafts = _metric(m, "tandem:spec_decode_num_drafts_total")
        draft_tokens = _metric(m, "tandem:spec_decode_num_draft_tokens_total")
        accepted = _metric(m, "tandem:spec_decode_num_accepted_tokens_total")
        per_pos = [_metric(m, "tandem:spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"')
                   for i in range(3)]
        assert drafts > 0 and draft_tokens == 3 * drafts
        assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
        assert info["avg_spec_accept_length"] == pytest.approx(1 + accepted / drafts, rel=1e-6)


def test_mismatched_draft_fails_at_start(ckpts, tmp_path):
    bad = build_assistant(os.path.join(tmp_path, "bad"), ckpts["gemma4"])
    with open(os.path.join(bad, "config.json")) as f:
        cfg = json.load(f)
    cfg["backbone_hidden_size"] = 96
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(cfg, f)
    proc = subprocess.run(
        [sys.executable, "-m", "tandem", "serve", "--model-path", ckpts["gemma4"], "--device", "cpu",
         "--speculative-algorithm", "FROZEN-KV-MTP", "--speculative-draft-model-path", bad, "--port", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode != 0
    assert "hidden" in proc.stderr and "96" in proc.stderr, proc.stderr[-2000:]
