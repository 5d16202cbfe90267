"""What a slow grammar compile costs the requests already running (CPU, no GPU needed).

A plain request streams on the bundled target; after ``--warm`` of its tokens a request with a
deeply nested JSON schema arrives (``--depth`` levels: xgrammar takes seconds on such schemas).
Reported: the schema's compile time alone, then the gaps between the plain request's steps before
and after the arrival (median, max). Since grammars compile before admission
(``scheduler_proc/grammar_gate.py``) the max gap after should stay near the median; before, the
constrained row's first sample waited for the compile and every row of that step with it.
The scheduler and the worker's runner run in one process (``tandem/inproc.py``: per-step timing).

    python benchmarks/grammar_stall_bench.py [--depth 300] [--tokens 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout to measure (an A/B runs it from another worktree)

TARGET = "models/tiny-shakespeare/target"


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def compile_seconds(schema: dict) -> float:
    import xgrammar as xgr
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(TARGET, "tokenizer.json"))
    vocab = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab))
    t = time.perf_counter()
    compiler.compile_json_schema(json.dumps(schema))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--warm", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    from proto.messages import GrammarSpec
    from tandem.inproc import InProcEngine

    schema = deep_schema(a.depth)
    alone = compile_seconds(schema)
    eng = InProcEngine(TARGET, device="cpu")
    stamps: list[float] = []
    take = eng._take

    def timed_take() -> None:
        n = len(eng.tokens["plain"])
        take()
        if len(eng.tokens["plain"]) > n:
            stamps.append(time.perf_counter())

    eng._take = timed_take
    eng.submit("plain", [5, 6, 7, 8, 9, 10], max_new_tokens=a.tokens, ignore_eos=True)
    eng.run(until=lambda: len(eng.tokens["plain"]) >= a.warm)
    arrival = time.perf_counter()
    eng.submit("deep", [11, 12, 13], max_new_tokens=8, grammar=GrammarSpec("json", json.dumps(schema)))
    eng.run(until=lambda: "plain" in eng.finish)
    eng.run()
    gaps = [b - x for x, b in zip(stamps, stamps[1:])]
    before = [g for g, t in zip(gaps, stamps[1:]) if t <= arrival]
    after = [g for g, t in zip(gaps, stamps[1:]) if t > arrival]
    out = {"depth": a.depth, "compile_alone_s": round(alone, 3),
           "gap_before_median_ms": round(1e3 * statistics.median(before), 2),
           "gap_after_median_ms": round(1e3 * statistics.median(after), 2),
           "gap_after_max_ms": round(1e3 * max(after), 2), "deep_finish": eng.finish.get("deep")}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
