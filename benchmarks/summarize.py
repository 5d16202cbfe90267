"""Print a markdown table from benchmarks/offline.py JSON results in a directory.

Besides wall-clock throughput it gives each run's CPU time per step of the worker and the
scheduler (and HF's per token): on a machine other work shares, wall time also counts waiting
for a core, CPU time much less so.
"""

from __future__ import annotations

import json
import os
import sys


def main(out: str) -> None:
    print("| run | output tok/s | accept len | draft ms/step | forward ms/step | scheduler ms/step | steps "
          "| worker CPU ms/step | scheduler CPU ms/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in sorted(os.listdir(out)):
        if not name.endswith(".json"):
            continue
        r = json.load(open(os.path.join(out, name)))
        if "engine" not in r:  # not an offline.py result (serve_footprint.py's)
            continue
        e = r["engine"]
        cpu = e.get("cpu_ms_per_step", {})
        print(f"| {name[:-5]} | {e['output_tok_s']:.1f} | {e.get('accept_length', 1.0):.2f} | "
              f"{e['draft_ms_per_step']:.2f} | {e['forward_ms_per_step']:.2f} | {e['scheduler_ms_per_step']:.2f} | "
              f"{e['steps']} | {cpu.get('worker', float('nan')):.2f} | {cpu.get('scheduler', float('nan')):.2f} |")
        if "hf_transformers" in r:
            hf = r["hf_transformers"]
            print(f"| {name[:-5]} (HF transformers generate, {hf.get('threads', '?')} threads) | "
                  f"{hf['output_tok_s']:.1f} | | | | | | {hf.get('cpu_ms_per_token', float('nan')):.2f} per token | |")


if __name__ == "__main__":
    main(sys.argv[1])
