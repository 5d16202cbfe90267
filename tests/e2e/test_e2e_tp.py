"""`tandem serve --tp-size 2 --device cpu`: two worker processes (gloo ranks) behind one
scheduler. Greedy output through the OpenAI client equals HF transformers (= TP=1); a rank
that dies takes the engine down with errors for in-flight requests; a model that cannot be
split fails at start-up with a message naming the flag."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from openai import AsyncOpenAI, OpenAI
from tokenizers import Tokenizer

from benchmarks.stream_ends import engine_children
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.server import ROOT, Server

PROMPTS = ["The quick brown fox", "Once upon a time there was", "def serve(model):", "café naïve"]



def test_tp2_mtp_greedy_equals_hf(ckpts):
    g, a = ckpts["gemma4"], ckpts["assistant"]
    tok = Tokenizer.from_file(f"{g}/tokenizer.json")
    refs = [hf_greedy(g, tok.encode(p).ids, 16, ignore_eos=True) for p in PROMPTS]
    flags = ["--tp-size", "2", "--speculative-algorithm", "FROZEN-KV-MTP", "--speculative-draft-model-path", a,
             "--chunked-prefill-size", "8"]
    with Server(g, *flags) as srv:
        assert engine_children(srv.proc.pid)["tandem-worker1"]  # a second rank really runs
        client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model=g, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == tok.decode(refs[0], skip_special_tokens=True)
        assert r.usage.completion_tokens == 16

        async def stream(client, p):
            s = await client.completions.create(model=g, prompt=p, max_tokens=16, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in s if c.choices])

        async def main():
            aclient = AsyncOpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
            return await asyncio.gather(*(stream(aclient, p) for p in PROMPTS))  # one batch, overlap on

        for text, ref in zip(asyncio.run(main()), refs):
            assert text == tok.decode(ref, skip_special_tokens=True)
        kw = dict(model=g, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, top_p=0.9, seed=77,
                  extra_body={"ignore_eos": True})
        assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text
        # A grammar compiles on every rank before admission (the leader answers for all).
        r = client.completions.create(model=g, prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    assert srv.proc.returncode == 0


def test_killing_a_follower_rank_fails_inflight_and_exits_nonzero(ckpts):
    path = ckpts["llama"]
    srv = Server(path, "--tp-size", "2")
    try:
        follower = engine_children(srv.proc.pid)["tandem-worker1"]

        async def main():
            client = AsyncOpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=30)
            started = asyncio.Event()

            async def long_stream():
                s = await client.completions.create(model=path, prompt="hello", max_tokens=400, stream=True,
                                                    extra_body={"ignore_eos": True})
                async for _ in s:
                    started.set()

            tasks = [asyncio.create_task(long_stream()) for _ in range(3)]
            await asyncio.wait_for(started.wait(), 20)
            os.kill(follower, signal.SIGKILL)
            t0 = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, time.monotonic() - t0

        results, elapsed = asyncio.run(main())
        assert elapsed < 10.0, f"in-flight requests took {elapsed:.1f}s to fail"
        assert all(isinstance(r, Exception) for r in results), results
        srv.proc.wait(timeout=20)
        assert srv.proc.returncode != 0
    finally:
        srv.stop()


def test_tp_size_that_does_not_divide_the_heads_fails_at_startup(ckpts):
    proc = subprocess.run(
        [sys.executable, "-m", "tandem", "serve", "--model-path", ckpts["llama"], "--device", "cpu",
         "--tp-size", "3", "--num-threads", "1", "--port", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode != 0
    assert "--tp-size 3" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
