"""Frozen-KV MTP through the scheduler + worker (in-process, CPU): lossless greedy output.

Greedy with MTP == greedy without MTP == HF generate, token for token, for 32 concurrent
requests of mixed lengths, with overlap on and off, chunked prefill, and requests that finish
in the middle of a multi-token chunk (length cap or stop token).
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.checkpoints import build_assistant, build_gemma4, hf_greedy
from tests.helpers.inproc import InProcEngine
from tests.helpers.oracle_draft import BigramDraft, bigram_table

N_REQ = 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    g = build_gemma4(os.path.join(root, "g"))
    a = build_assistant(os.path.join(root, "a"), g)
    prompts = [[(11 * i + 5 * j) % 370 + 6 for j in range(3 + (i * 13) % 45)] for i in range(N_REQ)]
    refs = [hf_greedy(g, p, 40, ignore_eos=True) for p in prompts]
    return g, a, prompts, refs


def _requests(prompts, refs):
    """Mixed finishing rules: length caps off the chunk grid and stop tokens mid-stream."""
    out = []
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        max_new = 5 + (i * 7) % 36
        kw = dict(max_new_tokens=max_new, ignore_eos=True)
        expect = ref[:max_new]
        if i % 3 == 0:
            stop = ref[min(6 + i % 5, max_new - 1)]
            kw["stop_token_ids"] = (stop,)
            expect = expect[: expect.index(stop) + 1]
        out.append((kw, expect))
    return out


def _check_requests(eng, prompts, refs) -> None:
    """Submit ``_requests``' mix, run to the end: every request's tokens as expected, every page free."""
    reqs = _requests(prompts, refs)
    for i, (p, (kw, _)) in enumerate(zip(prompts, reqs)):
        eng.submit(f"r{i}", p, **kw)
    eng.run()
    for i, (_, expect) in enumerate(reqs):
        assert eng.tokens[f"r{i}"] == expect, i
    eng.core.alloc.check_all_free()


@pytest.mark.parametrize("depth", [2, 1, 3])  # overlap depth (--overlap-depth; 1 = no overlap)
@pytest.mark.parametrize("draft", ["none", "random", "oracle"])
def test_mtp_lossless(pair, depth, draft):
    g, a, prompts, refs = pair
    eng = InProcEngine(g, draft=None if draft == "none" else a, steps=3, depth=depth,
                       chunked_prefill_size=24, page_size=4)
    if draft == "oracle":
        eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table([p + r for p, r in zip(prompts, refs)]))
    _check_requests(eng, prompts, refs)
    if draft == "oracle":
        # Multi-token steps really happened, full chains included.
        assert min(eng.core.counters.per_pos) > 10


@pytest.mark.parametrize("draft", ["none", "random"])
def test_mtp_lossless_with_compiled_cpu_steps(pair, ckpts, draft, monkeypatch):
    """The same, as `tandem serve` runs on the CPU by default: decode steps through the compiled
    programs (``graphs/cpu_steps.py``; the first run on a machine builds them). With the draft,
    in bfloat16 as on a CPU with bfloat16 instructions (the build ``test_cpu_steps.py`` makes);
    without one, the plain steps on Llama at the default page size (the build ``LLM`` makes in
    ``tests/e2e/test_llm.py``), against HF's tokens: one build each serves both tests."""
    g, a, prompts, refs = pair
    if draft == "none":
        g, prompts = ckpts["llama"], prompts[:16]
        refs = [hf_greedy(g, p, 40, ignore_eos=True) for p in prompts]
        eng = InProcEngine(g, compiled=True, chunked_prefill_size=24)
    else:
        from gpu_worker import main

        monkeypatch.setattr(main, "native_bf16", lambda: True)
        eng = InProcEngine(g, draft=a, steps=3, compiled=True, chunked_prefill_size=24, page_size=4)
    assert eng.runner.graphs is not None
    _check_requests(eng, prompts, refs)


def test_stress_real_worker_admit_abort_finish(pair):
    """The real worker (MTP, overlap) under churn: requests admitted, aborted and finishing
    nearly every step; afterwards every page and slot is free and outputs stay exact."""
    import random
    from collections import deque

    from proto.messages import AbortReq
    from tests.helpers.inproc import _dec_plan, _dec_result, _enc

    g, a, prompts, refs = pair
    eng = InProcEngine(g, draft=a, steps=3, overlap=True, chunked_prefill_size=16, page_size=4,
                       max_running_requests=6, max_total_tokens=1024)
    eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table([p + r for p, r in zip(prompts, refs)]))
    rng = random.Random(7)
    pending, submitted, aborted = deque(), {}, set()
    for step in range(5000):
        if step >= 500 and eng.core.idle() and not pending:
            break
        if step < 500 and rng.random() < 0.6:
            i = rng.randrange(len(prompts))
            rid = f"s{step}"
            submitted[rid] = i
            eng.submit(rid, prompts[i], max_new_tokens=rng.randrange(1, 40), ignore_eos=True)
        live = [r for r in submitted if r not in eng.finish and r not in aborted]
        if step < 500 and live and rng.random() < 0.25:
            rid = rng.choice(live)
            aborted.add(rid)
            eng.core.abort(AbortReq(rid))
        while len(eng.core.inflight) < 2 and (plan := eng.planner.plan()) is not None:
            pending.append(eng.runner.launch(_dec_plan.decode(_enc.encode(plan))))
        if pending:
            eng.core.on_result(_dec_result.decode(_enc.encode(pending.popleft().result())))
        for out in eng.core.take_outputs():
            eng.tokens[out.rid].extend(__import__("numpy").frombuffer(out.token_ids, "<i4").tolist())
            if out.finish_reason:
                eng.finish[out.rid] = out.finish_reason
    assert set(eng.finish) == set(submitted)
    for rid, i in submitted.items():
        if eng.finish[rid] != "abort":
            assert eng.tokens[rid] == refs[i][: len(eng.tokens[rid])], rid
    eng.core.alloc.check_all_free()
    assert not eng.core.running and not eng.core.by_slot
