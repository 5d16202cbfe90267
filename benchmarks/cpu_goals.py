"""Issue 42's goals, read from one ``benchmarks/cpu_suite.sh`` output directory.

    python benchmarks/cpu_goals.py OUT_DIR

One request: MTP >= 3x HF ``generate``'s tok/s, plain >= 1.5x; 8 requests: MTP >= 3x its one-request
figure; accept length >= 3.0; the RSS of all of ``tandem serve``'s processes <= 500 MB idle and
under 8 streams; time to ready < 10 s. Each line gives the figure, the goal and the eager
(``--disable-cuda-graph``) figure from the same run where there is one.
"""

from __future__ import annotations

import json
import os
import sys


def _load(out: str, name: str) -> dict | None:
    path = os.path.join(out, f"{name}.json")
    return json.load(open(path)) if os.path.exists(path) else None


def _tok_s(r: dict | None) -> float:
    return r["engine"]["output_tok_s"] if r else float("nan")


def main(out: str) -> None:
    plain, mtp, mtp8 = _load(out, "c1_plain"), _load(out, "c1_mtp"), _load(out, "c8_mtp")
    hf = plain["hf_transformers"]["output_tok_s"] if plain and "hf_transformers" in plain else float("nan")
    rows = [
        ("1 request, MTP / HF", _tok_s(mtp) / hf, 3.0, _tok_s(_load(out, "c1_mtp_eager")) / hf),
        ("1 request, plain / HF", _tok_s(plain) / hf, 1.5, _tok_s(_load(out, "c1_plain_eager")) / hf),
        ("8 requests / 1 request, MTP", _tok_s(mtp8) / _tok_s(mtp), 3.0,
         _tok_s(_load(out, "c8_mtp_eager")) / _tok_s(_load(out, "c1_mtp_eager"))),
        ("accept length, 1 request", mtp["engine"].get("accept_length", float("nan")) if mtp else float("nan"), 3.0,
         None),
    ]
    print(f"HF transformers generate: {hf:.1f} tok/s\n")
    print("| goal | figure | needed | eager |")
    print("|---|---|---|---|")
    for name, got, need, eager in rows:
        mark = "ok" if got >= need else "MISSED"
        print(f"| {name} | {got:.2f} {mark} | >= {need} | {'' if eager is None else f'{eager:.2f}'} |")
    for tag, name in (("compiled", "serve"), ("eager", "serve_eager"), ("compiled, first start", "serve_cold")):
        s = _load(out, name)
        if s is None:
            continue
        idle, busy = s["idle"], next(v for k, v in s.items() if k.startswith("streams_"))
        goal = "" if s.get("cold") else " (< 10)"  # the goal is for a start with the programs built
        print(f"\n`tandem serve` ({tag}): ready {s['ready_s']} s{goal}, first 1-token request {s['ttft_first_ms']} ms, "
              f"then median {s['ttft_ms']} ms")
        print(f"RSS total idle {idle['total']['rss_mb']} MB, under 8 streams {busy['total']['rss_mb']} MB (<= 500); "
              f"PSS {idle['total']['pss_mb']} / {busy['total']['pss_mb']} MB")
        for proc, mem in idle["processes"].items():
            b = busy["processes"].get(proc, {})
            print(f"  {proc}: idle {mem['rss_mb']} MB, under streams {b.get('rss_mb')} MB, "
                  f"{b.get('cpu_s', '?')} CPU s over them, {b.get('threads', '?')} threads")


if __name__ == "__main__":
    main(sys.argv[1])
