"""How big the KV pool, the slot table and the context can be on this device.

GPU: like SGLang's --mem-fraction-static, weights + KV pool take that fraction of the card's
memory; what the loaded weights left of it, minus an activation reserve, becomes KV pages.
CPU: what the engine can use: every running request (--max-running-requests, default
CPU_DEFAULT_SLOTS) at the full context (--context-length, else the model's limit), capped by a
share of RAM. The pool's pages are zero pages of the OS until written (``kv_pool.py``), so its
resident memory follows the KV actually written, up to that size.
Tensor parallelism: sizes are per rank (each pool holds only the rank's KV heads, so
bytes/token shrinks with --tp-size); CPU ranks share the host's RAM share; all ranks then
agree on the smallest page count, since one plan addresses the same pages on every rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from gpu_worker.kv_pool import KVPool
from gpu_worker.parallel.state import agree_min, tp_size

log = logging.getLogger("tandem.worker")

PROMPT_LOGPROB_ROWS = 1024  # step/prompt_logprobs.py: logits rows materialised at once
CPU_RAM_SHARE = 0.2
# Two cores run a decode step's rows one after another: past about eight rows a step's time grows
# with them, so more running requests add latency rather than throughput.
CPU_DEFAULT_SLOTS = 8


@dataclass(frozen=True)
class Capacity:
    num_pages: int  # including page 0 (padding)
    max_slots: int
    max_pages_per_slot: int
    max_context: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _budget_tokens(args, device: torch.device, bpt: int, want: int, vocab: int, t: int) -> int:
    """KV tokens for the pool; ``want``: one request's worst case (a full context + slack)."""
    if args.max_total_tokens:
        return args.max_total_tokens
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Activations, and the logits of the rows a step samples (every decode row's T tokens plus
        # a sampled prefill row each, or a block of prompt-logprob rows) in the model dtype and
        # three float32 copies (softcap / processors, softmax, sampling): only those rows reach
        # the LM head, never a whole prefill chunk.
        rows = max(PROMPT_LOGPROB_ROWS, (args.max_running_requests or 256) * (t + 1))
        reserve = (1 << 30) + rows * vocab * (2 + 4 * 3)
        budget = total * args.mem_fraction_static - (total - free) - reserve
        return max(int(budget // bpt), 0)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    whole = _cdiv(want, args.page_size) * args.page_size  # a request holds whole pages
    return min(int(ram * CPU_RAM_SHARE / tp_size() // bpt), (args.max_running_requests or CPU_DEFAULT_SLOTS) * whole)


def plan_capacity(args, target, device: torch.device, dtype, t: int, model_max_pos: int) -> Capacity:
    ps = args.page_size
    max_context = args.context_length or model_max_pos
    bpt = KVPool.bytes_per_token(target.kv_shapes, dtype)
    slack = 2 * t + ps  # the in-flight worst case on top of a full context
    tokens = agree_min(_budget_tokens(args, device, bpt, max_context + slack, target.vocab_size, t))
    num_pages = tokens // ps + 1
    if (num_pages - 1) * ps < max_context + slack:
        capped = (num_pages - 1) * ps - slack
        if capped < 2 * ps:
            raise RuntimeError(f"--max-total-tokens / memory: room for only {tokens} KV tokens, too few to serve")
        log.warning("context length capped from %d to %d by the KV pool size", max_context, capped)
        max_context = capped
    default_slots = 256 if device.type == "cuda" else CPU_DEFAULT_SLOTS
    max_slots = min(args.max_running_requests or default_slots, num_pages - 1)
    log.info("KV pool: %d tokens (%d pages of %d), %.0f MiB; %d running requests, context %d", (num_pages - 1) * ps,
             num_pages - 1, ps, num_pages * ps * bpt / 2**20, max_slots, max_context)
    return Capacity(num_pages, max_slots, _cdiv(max_context + slack, ps) + 1, max_context)
