"""After start-up (prefill warm-up + graph capture), serving compiles no Triton variant: short
prompts alone in their step, mixed steps whose decode rows start at odd offsets, greedy
selection and the longest-first order all reuse what start-up built (a compile mid-serving costs
a step about half a second)."""

from __future__ import annotations

import torch

from tests.helpers.checkpoints import build_qwen3
from tests.helpers.inproc import InProcEngine


def test_serving_compiles_nothing_after_start_up(tmp_path, monkeypatch):
    from triton import knobs

    d = build_qwen3(str(tmp_path / "qwen3"))
    eng = InProcEngine(d, device="cuda", dtype="bfloat16", max_running_requests=64, chunked_prefill_size=96,
                       max_total_tokens=65536)
    compiled = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled.append(str(kw.get("repr"))[:120]))
    for n in (2, 8, 13):  # short prompts alone in their step: extend rows, not a decode variant per length
        eng.submit(f"short{n}", [(5 * j + n) % 300 + 6 for j in range(n)], max_new_tokens=4, ignore_eos=True)
        eng.run()
    for wave in range(3):  # later waves prefill beside the earlier ones' decode rows
        for i in range(20):
            n = 5 + (37 * i + 11 * wave) % 150
            eng.submit(f"w{wave}r{i}", [(7 * j + i) % 300 + 6 for j in range(n)], max_new_tokens=12 + i,
                       ignore_eos=True)
        done = eng.core.counters.steps
        eng.run(until=lambda: eng.core.counters.steps >= done + 4)
    eng.run()
    assert sum(len(v) for v in eng.tokens.values()) == sum(3 * (12 + i) for i in range(20)) + 3 * 4
    torch.cuda.synchronize()
    assert compiled == []
