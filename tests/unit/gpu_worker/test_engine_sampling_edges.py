"""Edge cases of the real worker's sampling and scheduling (in-process engine, tiny Gemma 4 pair,
CPU): huge top-k, penalties over prefix-cached prompts and across preemption, one-token
requests at the context edge, churn against a plain engine, prompt logprobs of long prompts."""

from __future__ import annotations

import os

import pytest

from tests.helpers import hf_ref
from tests.helpers.checkpoints import build_assistant, build_gemma4, hf_greedy
from tests.helpers.inproc import InProcEngine
from tests.helpers.oracle_draft import BigramDraft, bigram_table

PROMPT = [(7 * j) % 370 + 6 for j in range(26)]
REP_PROMPT = [(62 * j + 22) % 370 + 6 for j in range(26)]  # the penalty on its tokens changes argmax


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("review")
    g = build_gemma4(os.path.join(root, "g"))
    return g, build_assistant(os.path.join(root, "a"), g)


def test_huge_top_k_does_not_kill_the_worker(pair):
    """The front accepts any top_k >= -1 (msgspec decodes up to 2**64-1); the worker stored it
    in an int64 tensor and died with OverflowError, taking the whole server down."""
    g, _ = pair
    eng = InProcEngine(g, page_size=4)
    eng.submit("huge", PROMPT, max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=5, top_k=2**64 - 1)
    eng.submit("off", PROMPT, max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=5, top_k=-1)
    eng.run()
    assert eng.finish["huge"] == "length"
    assert eng.tokens["huge"] == eng.tokens["off"]  # top_k beyond the vocabulary filters nothing


@pytest.mark.parametrize("mtp", [False, True])
def test_repetition_penalty_sees_prefix_cached_prompt_tokens(pair, mtp):
    """A prefix-cache hit skips computing the cached prompt pages, and the worker only marks
    prompt tokens it computes as "seen": repetition_penalty ignored every cached prompt token,
    so a penalised request's output depended on what ran before it."""
    g, a = pair
    eng = InProcEngine(g, draft=a if mtp else None, steps=3, page_size=4)
    eng.submit("warm", REP_PROMPT, max_new_tokens=4, ignore_eos=True)
    eng.run()
    ref = hf_ref.greedy(g, REP_PROMPT, 16, repetition=1.5, ignore_eos=True)
    if mtp:
        eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table([REP_PROMPT + ref]))
    eng.submit("pen", REP_PROMPT, max_new_tokens=16, ignore_eos=True, repetition_penalty=1.5)
    eng.run()
    assert eng.tokens["pen"] == ref


def test_frequency_penalty_exact_across_preemption(pair):
    """A preempted request's re-prefill hits its own published pages (prompt + outputs); the
    output tokens inside the hit were never re-counted, so frequency/presence penalties forgot
    them after a preemption."""
    g, _ = pair
    ref = hf_ref.greedy(g, PROMPT, 40, frequency=0.8, presence=0.4, ignore_eos=True)
    eng = InProcEngine(g, page_size=4, max_total_tokens=4 * 40, chunked_prefill_size=64, max_running_requests=4)
    for i in range(4):
        eng.submit(f"f{i}", PROMPT, max_new_tokens=40, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.4)
    eng.run()
    assert eng.core.counters.preemptions > 0
    for i in range(4):
        assert eng.tokens[f"f{i}"] == ref, i


@pytest.mark.parametrize("overlap", [True, False])
def test_one_token_requests_and_context_edge_with_mtp(pair, overlap):
    g, a = pair
    eng = InProcEngine(g, draft=a, steps=3, overlap=overlap, page_size=4, context_length=48)
    ref = hf_greedy(g, PROMPT, 8, ignore_eos=True)
    eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table([PROMPT + ref]))
    edge = [(5 * j) % 370 + 6 for j in range(47)]
    eng.submit("one", PROMPT, max_new_tokens=1, ignore_eos=True)
    eng.submit("edge", edge, max_new_tokens=40, ignore_eos=True)
    eng.submit("short", [9], max_new_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    eng.run()
    assert eng.tokens["one"] == ref[:1] and eng.finish["one"] == "length"
    assert eng.tokens["edge"] == hf_greedy(g, edge, 1, ignore_eos=True) and eng.finish["edge"] == "length"
    assert eng.tokens["short"] == hf_greedy(g, [9], 3, ignore_eos=True)
    # A one-token prompt has no prompt logprobs; the engine says so (an empty row) instead of
    # sending nothing, which the front read as "not requested" (/generate dropped
    # input_token_logprobs for such prompts).
    (plp,) = [o.prompt_logprobs for o in eng.outputs["short"] if o.prompt_logprobs is not None]
    assert plp.token_logprobs == b"" and plp.top_ids == b""
    eng.core.alloc.check_all_free()


def _mixed_requests(rng, n=40):
    """Shared prefixes, penalties, min_tokens, stop ids, logprobs, prompt logprobs, seeded
    sampling with filters: every per-request worker state at once."""
    base = [[rng.randrange(6, 370) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    out = []
    for i in range(n):
        p = list(rng.choice(base))
        if rng.random() < 0.5:
            p += [rng.randrange(6, 370) for _ in range(rng.randrange(0, 10))]
        kw = dict(max_new_tokens=rng.randrange(1, 30), ignore_eos=rng.random() < 0.7)
        r = rng.random()
        if r < 0.2:
            kw["repetition_penalty"] = rng.choice([0.7, 1.3])
        elif r < 0.4:
            kw.update(frequency_penalty=0.5, presence_penalty=0.3)
        if rng.random() < 0.2:
            kw["min_new_tokens"] = min(kw["max_new_tokens"], rng.randrange(0, 8))
        if rng.random() < 0.3:
            kw["logprobs"] = rng.choice([0, 3])
        if rng.random() < 0.1:
            kw["prompt_logprobs"] = 2
        if rng.random() < 0.3:
            kw.update(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(1 << 40), top_p=rng.choice([1.0, 0.9]),
                      top_k=rng.choice([-1, 20]), min_p=rng.choice([0.0, 0.05]))
        if rng.random() < 0.2:
            kw["stop_token_ids"] = (rng.randrange(6, 370),)
        out.append((f"r{i}", p, kw))
    return out


@pytest.mark.parametrize("mtp,depth", [(False, 2), (True, 2), (True, 1), (False, 3), (True, 3)])
@pytest.mark.parametrize("seed", [1, 3])
def test_churn_matches_a_plain_engine(pair, mtp, depth, seed):
    """Tight pool (preemptions), small chunks, prefix hits, cache flushes and aborts mid-flight,
    with every sampling feature: each request's tokens, finish reason, logprobs and prompt
    logprobs equal a plain engine's (depth 1, no cache, roomy pool), at overlap depth 1, 2 and 3
    (``--overlap-depth``: three steps launched ahead of the results processed). Seeded sampled
    rows are compared without MTP only (the verify draws its randomness differently)."""
    import random
    from collections import deque

    import numpy as np

    from proto.messages import AbortReq
    from tests.helpers.inproc import _dec_plan, _dec_result, _enc

    g, a = pair
    rng = random.Random(seed)
    reqs = _mixed_requests(rng)
    ref = InProcEngine(g, overlap=False, page_size=4, disable_prefix_cache=True)
    for rid, p, kw in reqs:
        ref.submit(rid, p, **kw)
    ref.run()
    eng = InProcEngine(g, draft=a if mtp else None, steps=3, depth=depth, page_size=4, chunked_prefill_size=16,
                       max_total_tokens=120, max_running_requests=6)
    if mtp:
        eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table([p + ref.tokens[r] for r, p, _ in reqs]))
    pending, todo, aborted = deque(), list(reqs), set()
    for step in range(1, 20000):
        if not todo and eng.core.idle() and not pending:
            break
        if todo and rng.random() < 0.5:
            rid, p, kw = todo.pop(0)
            eng.submit(rid, p, **kw)
        if step % 37 == 0:
            eng.core.alloc.flush()
        live = [r for r, _, _ in reqs if r in eng.core.by_rid and r not in eng.finish]
        if live and rng.random() < 0.03:
            aborted.add(x := rng.choice(live))
            eng.core.abort(AbortReq(x))
        while len(eng.core.inflight) < eng.depth and (plan := eng.planner.plan()) is not None:
            pending.append(eng.runner.launch(_dec_plan.decode(_enc.encode(plan))))
        if pending:
            eng.core.on_result(_dec_result.decode(_enc.encode(pending.popleft().result())))
        for out in eng.core.take_outputs():
            eng.outputs[out.rid].append(out)
            eng.tokens[out.rid].extend(np.frombuffer(out.token_ids, "<i4").tolist())
            if out.finish_reason:
                eng.finish[out.rid] = out.finish_reason
    assert eng.core.counters.preemptions > 0 and eng.core.counters.prefix_hits > 0
    eng.core.alloc.check_all_free()

    def lps(e, rid, field):
        return np.concatenate([np.frombuffer(getattr(o, field).token_logprobs, "<f4") for o in e.outputs[rid]
                               if getattr(o, field) is not None] or [np.zeros(0, np.float32)])

    for rid, p, kw in reqs:
        if mtp and "seed" in kw:
            continue
        got, want = eng.tokens[rid], ref.tokens[rid]
        if rid in aborted:
            assert got == want[: len(got)], rid
            continue
        assert (got, eng.finish[rid]) == (want, ref.finish[rid]), (rid, kw)
        if kw.get("logprobs", -1) >= 0:
            assert np.allclose(lps(eng, rid, "logprobs"), lps(ref, rid, "logprobs"), atol=1e-4), rid
        if kw.get("prompt_logprobs", -1) >= 0:
            assert np.allclose(lps(eng, rid, "prompt_logprobs"), lps(ref, rid, "prompt_logprobs"), atol=1e-4), rid


def test_prompt_logprobs_of_a_long_prompt_are_computed_in_blocks(pair, monkeypatch):
    """Prompt-logprob prompts run as one chunk whatever their length; their [n, vocab] logits
    (and log_softmax) used to be materialised at once, an out-of-memory kill of the worker for
    a long prompt on a large vocabulary. Values must not change."""
    import numpy as np

    import gpu_worker.step.prompt_logprobs as plp

    g, _ = pair
    prompt = [(13 * j) % 370 + 6 for j in range(45)]

    def run():
        eng = InProcEngine(g, page_size=4)
        rows = []
        real = eng.runner.target.compute_logits

        def spy(h):
            rows.append(h.shape[0])
            return real(h)

        eng.runner.target.compute_logits = spy
        eng.submit("p", prompt, max_new_tokens=2, prompt_logprobs=3)
        eng.run()
        (lp,) = [o.prompt_logprobs for o in eng.outputs["p"] if o.prompt_logprobs is not None]
        return rows, [np.frombuffer(lp.token_logprobs, "<f4"), np.frombuffer(lp.top_ids, "<i4")]

    _, whole = run()
    monkeypatch.setattr(plp, "BLOCK_ROWS", 8)
    rows, blocked = run()
    assert max(rows) <= 8
    assert len(whole[0]) == len(prompt) - 1
    assert np.allclose(whole[0], blocked[0], atol=1e-5) and (whole[1] == blocked[1]).all()
