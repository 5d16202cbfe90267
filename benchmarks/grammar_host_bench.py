"""Host cost of structured output per step (gpu_worker/structured/grammar.py), no GPU needed: the mask
building of ``GrammarRows.apply`` and the token feed of ``observe`` for B constrained rows of
a JSON-schema grammar over a 150k-token vocabulary, with 1 and 4 positions per row (MTP S=3),
plus one schema's compile. ``fill_ms`` is the host part (xgrammar's masks): it runs on the
worker's thread in every constrained step on any device; the rest of ``apply_ms`` (unpacking
and masking [rows x vocab] logits) is device work on the GPU and CPU work only on the CPU.

    python benchmarks/grammar_host_bench.py [--rows 1,8,32] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}}}


def make_rows(vocab: int):
    import xgrammar as xgr

    from gpu_worker.structured.grammar import GrammarRows

    # A byte-level-like vocabulary: single characters first (JSON needs them), then words.
    chars = [chr(c) for c in range(32, 127)]
    words = [f"{w}{i}" for i, w in enumerate(["a", "name", "\"", " ", "ab", "x1"] * (vocab // 6))]
    enc = (chars + words)[: vocab - 1] + ["</s>"]
    rows = GrammarRows(None, vocab, (vocab - 1,), torch.device("cpu"))
    rows._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(enc, xgr.VocabType.RAW, vocab_size=vocab,
                                                           stop_token_ids=[vocab - 1]))
    return rows, enc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    import xgrammar as xgr

    from proto.messages import GrammarSpec

    rows, enc = make_rows(a.vocab)
    t = time.perf_counter()
    compiled = rows._compiler.compile_json_schema(json.dumps(SCHEMA))
    print(json.dumps({"compile_ms": round(1e3 * (time.perf_counter() - t), 1), "vocab": a.vocab}))
    _ = GrammarSpec  # (the worker's spec type; compiled directly here)
    opening = [enc.index(c) for c in '{"name":"']  # a state inside a string: the widest masks
    for b in map(int, a.rows.split(",")):
        for n in (1, 4):
            rows.matchers = {s: xgr.GrammarMatcher(compiled) for s in range(1, b + 1)}
            for m in rows.matchers.values():
                for tok in opening:
                    assert m.accept_token(tok)
            slots = np.arange(1, b + 1)
            logits = torch.zeros(b * n, a.vocab)
            drafts = torch.full((b, n - 1), enc.index("a"), dtype=torch.int64) if n > 1 else None
            t = time.perf_counter()
            for _ in range(a.iters):
                rows.apply(logits, logits, slots, drafts)
            apply_ms = 1e3 * (time.perf_counter() - t) / a.iters
            mask = torch.full((b * n, rows.words), -1, dtype=torch.int32)
            d_host = None if drafts is None else drafts.numpy()
            t = time.perf_counter()
            for _ in range(a.iters):  # the host part alone (on the GPU the rest is device work)
                for r, m in enumerate(rows.matchers.values()):
                    rows._fill(m, mask, r * n, None if d_host is None else d_host[r])
            fill_ms = 1e3 * (time.perf_counter() - t) / a.iters
            toks = np.full((b, n), enc.index("a"), dtype=np.int32)
            t = time.perf_counter()
            rows.observe(slots, toks, np.ones(b, dtype=np.int32))
            observe_ms = 1e3 * (time.perf_counter() - t)
            print(json.dumps({"rows": b, "positions": n, "apply_ms": round(apply_ms, 3), "fill_ms": round(fill_ms, 3),
                              "observe_ms": round(observe_ms, 3)}))


if __name__ == "__main__":
    main()
