"""Launch shapes of the MoE expert kernels, per model shape, from ``moe_configs.json``.

The file holds one entry per (experts E, hidden H, this rank's expert intermediate I, experts
per token K) and a ``default``; an entry's ``decode_fp8`` / ``gemm_fp8``, where present, serve
e4m3 experts (``moe_tune.py --fp8`` measures them), else its ``decode`` / ``gemm`` do. Its
numbers are reasoned from a Hopper card's resources (132 SMs, ~3 TB/s of HBM, 227 KiB of shared
memory a block); ``benchmarks/moe_tune.py`` measures candidates and writes entries in the same
form. The reasoning behind the defaults:

- decode (1-4 tokens, ``moe_decode.py``): each selected expert's weights are streamed once, so
  the launch must keep HBM busy with few experts: at one token, top-8 of 128 experts with
  I = 704 and 16 outputs per gate_up tile gives 8 x 44 = 352 programs (about three per SM, all
  resident with 4 stages of a 32 x 128 tile); down tiles of 64 rows give 8 x 44 = 352 too.
  BLOCK_K divides I where it can (704 = 11 x 64) so no K tile is half masked.
- grouped (``moe_gemm.py``): BLOCK_M follows the pairs an expert gets: at 64 tokens x 8 slots
  over 128 experts about 4 (16-row blocks, the smallest ``tl.dot`` tile), at 256 tokens about
  16 (32-row blocks), at prefill sizes hundreds (64-row blocks with GROUP_M = 8 so that the
  blocks of one expert reuse its weight tiles from L2). Shared memory stays under ~120 KiB a
  block so two blocks fit on an SM.
"""

from __future__ import annotations

import functools
import json
import os

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_configs.json")


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    with open(PATH) as f:
        return json.load(f)["shapes"]


def shape_key(num_experts: int, hidden: int, intermediate: int, top_k: int) -> str:
    return f"E={num_experts},H={hidden},I={intermediate},K={top_k}"


def _entry(num_experts: int, hidden: int, intermediate: int, top_k: int) -> dict:
    table = _table()
    return table.get(shape_key(num_experts, hidden, intermediate, top_k), table["default"])


def _part(entry: dict, name: str, fp8: bool):
    return entry.get(f"{name}_fp8", entry[name]) if fp8 else entry[name]


def decode_config(num_experts: int, hidden: int, intermediate: int, top_k: int, pass_name: str,
                  fp8: bool = False) -> dict:
    """The decode path's launch shape for ``pass_name`` (``gate_up`` or ``down``)."""
    return _part(_entry(num_experts, hidden, intermediate, top_k), "decode", fp8)[pass_name]


def gemm_config(num_experts: int, hidden: int, intermediate: int, top_k: int, tokens: int, fp8: bool = False) -> dict:
    """The grouped path's bucket for ``tokens``: ``block_m`` and the ``gate_up`` / ``down`` tiles."""
    buckets = _part(_entry(num_experts, hidden, intermediate, top_k), "gemm", fp8)
    return next((b for b in buckets if tokens <= b["max_tokens"]), buckets[-1])
