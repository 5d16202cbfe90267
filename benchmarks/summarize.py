"""Print a markdown table from benchmarks/offline.py JSON results in a directory."""

from __future__ import annotations

import json
import os
import sys


def main(out: str) -> None:
    print("| run | output tok/s | accept len | draft ms/step | forward ms/step | scheduler ms/step | steps |")
    print("|---|---|---|---|---|---|---|")
    for name in sorted(os.listdir(out)):
        if not name.endswith(".json"):
            continue
        r = json.load(open(os.path.join(out, name)))
        e = r["engine"]
        print(f"| {name[:-5]} | {e['output_tok_s']:.1f} | {e.get('accept_length', 1.0):.2f} | "
              f"{e['draft_ms_per_step']:.2f} | {e['forward_ms_per_step']:.2f} | {e['scheduler_ms_per_step']:.2f} | "
              f"{e['steps']} |")
        if "hf_transformers" in r:
            print(f"| {name[:-5]} (HF transformers generate) | {r['hf_transformers']['output_tok_s']:.1f} | | | | | |")


if __name__ == "__main__":
    main(sys.argv[1])
