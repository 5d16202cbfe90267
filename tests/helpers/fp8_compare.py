"""Engine-level FP8 comparisons the FP8 tests share: an engine's greedy tokens, and its
teacher-forced log-probabilities against an unquantized float32 reference (greedy agreement and
the largest error, printed and bounded)."""

from __future__ import annotations

import numpy as np

from tests.helpers.inproc import InProcEngine

PROMPTS = [[(11 * i + 5 * j) % 370 + 6 for j in range(4 + 7 * i)] for i in range(4)]
NEW = 12


def generate(path: str, prompts=PROMPTS, new: int = NEW, **kw) -> list[list[int]]:
    eng = InProcEngine(path, page_size=4, chunked_prefill_size=32, **kw)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new_tokens=new, ignore_eos=True)
    eng.run()
    eng.core.alloc.check_all_free()
    return [eng.tokens[f"r{i}"] for i in range(len(prompts))]


def _teacher_forced(path: str, prompts, conts, **kw) -> tuple[np.ndarray, np.ndarray]:
    """(log-probability of each continuation token after its prompt, the engine's own top token
    there), all continuations concatenated: one request per prompt + continuation, prompt logprobs."""
    eng = InProcEngine(path, page_size=4, chunked_prefill_size=32, **kw)
    for i, (p, c) in enumerate(zip(prompts, conts)):
        eng.submit(f"r{i}", p + c, max_new_tokens=1, prompt_logprobs=1, ignore_eos=True)
    eng.run()
    lps, tops = [], []
    for i, (p, c) in enumerate(zip(prompts, conts)):
        parts = [o.prompt_logprobs for o in eng.outputs[f"r{i}"] if o.prompt_logprobs is not None]  # per chunk
        lp = np.concatenate([np.frombuffer(x.token_logprobs, np.float32) for x in parts])
        top = np.concatenate([np.frombuffer(x.top_ids, np.int32) for x in parts])
        assert len(lp) == len(top) == len(p) + len(c) - 1
        lps.append(lp[len(p) - 1:])
        tops.append(top[len(p) - 1:])
    return np.concatenate(lps), np.concatenate(tops)


def compare(ref_path: str, path: str, bound: float, what: str, **kw) -> tuple[float, float]:
    """(greedy agreement, max logprob error) of ``path``'s engine (with ``kw``) against
    ``ref_path``'s unquantized float32 one on the reference's greedy continuations, teacher-forced:
    the share of positions whose top token is the reference's, and the largest difference of the
    continuation tokens' log-probabilities. Printed; the error bounded by ``bound``."""
    ref = generate(ref_path)
    lp_ref, _ = _teacher_forced(ref_path, PROMPTS, ref)
    lp, top = _teacher_forced(path, PROMPTS, ref, **kw)
    agree = float(np.mean(top == np.concatenate(ref)))
    err = float(np.abs(lp - lp_ref).max())
    print(f"{what}: greedy agreement {agree:.3f}, max logprob error {err:.4f} nats (bound {bound:.3f})")
    assert err < bound and agree >= 0.75
    return agree, err


_YARDSTICK: dict[str, float] = {}


def fp8_bound(path: str, what: str) -> float:
    """The bound an FP8 error gets: 16x what bf16 loses against float32 on the same model and
    continuations (e4m3 keeps 4 significant bits, bf16 8: a rounding 16x as coarse), at least 0.1."""
    if path not in _YARDSTICK:
        _YARDSTICK[path] = compare(path, path, 1.0, f"bf16 vs float32 ({what}), the yardstick", dtype="bfloat16")[1]
    return max(0.1, 16 * _YARDSTICK[path])
