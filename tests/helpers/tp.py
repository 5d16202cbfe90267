"""Run the same checks at TP=1 (this process) and TP=2 (two spawned gloo ranks on the CPU).

``run_ranks(fn, n, *args)`` spawns ``n`` processes that join one gloo group (FileStore in a
temp dir), run ``fn(rank, *args)`` and send back its (picklable) result; a rank that fails or
hangs fails the caller within ``timeout`` seconds, with its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback

import numpy as np
import torch

PROMPTS = [[5, 17, 33, 99, 120, 7, 8, 9, 10, 11] * 3, [4, 5, 6], list(range(10, 60))]
NEW_TOKENS = 12
SAMPLED = dict(temperature=0.9, top_p=0.9, seed=1234)  # seeded: every rank must draw alike


def _child(rank: int, n: int, init: str, device: str, fn, args, out) -> None:
    try:
        from gpu_worker.parallel.state import destroy_tp, init_tp

        torch.set_num_threads(1)
        init_tp(rank, n, init, torch.device(device))  # NCCL on CUDA (rank r on cuda:r), gloo on CPU
        try:
            out.put((rank, "ok", fn(rank, *args)))
        finally:
            destroy_tp()
    except BaseException:  # report, never hang the parent
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, n: int, *args, timeout: float = 240.0, device: str = "cpu") -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(r, n, init, device, fn, args, out), daemon=True) for r in range(n)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        try:
            while len(results) < n:
                rank, status, value = out.get(timeout=timeout)
                if status != "ok":
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                results[rank] = value
        except queue.Empty:
            raise AssertionError(f"ranks {sorted(set(range(n)) - set(results))} gave no result in {timeout}s") from None
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(n)]


# ------------------------------------------------------------------ what each rank computes


def engine_tokens(model: str, draft: str | None = None, device: str = "cpu") -> dict[str, list[int]]:
    """Greedy continuations of PROMPTS (plus one seeded sampled request) through the scheduler
    core and the worker's runner, overlap depth 2, chunked prefill below the longest prompt.
    Every rank runs its own scheduler core: deterministic, so each gets the same plans."""
    from tests.helpers.inproc import InProcEngine

    eng = InProcEngine(model, draft=draft, steps=3, chunked_prefill_size=16, max_total_tokens=4096,
                       device=device, dtype="float32")
    for i, p in enumerate(PROMPTS):
        eng.submit(f"g{i}", p, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    eng.submit("s0", PROMPTS[0], max_new_tokens=NEW_TOKENS, ignore_eos=True, **SAMPLED)
    eng.run()
    return {rid: list(toks) for rid, toks in eng.tokens.items()}


def model_logits(model_dir: str) -> tuple[np.ndarray, list[int]]:
    """(logits of every token of a paged prefill then one decode step [T, V], the KV heads
    per pool layer this rank holds)."""
    from gpu_worker.models.loader import load_model
    from tests.unit.model_harness import PagedHarness

    model = load_model(model_dir, torch.float32, "cpu")
    h = PagedHarness(model.kv_shapes, model.sliding_windows, device="cpu")
    a, b = h.new_slot(), h.new_slot()
    with torch.inference_mode():
        first = h.extend(model, [(a, PROMPTS[0]), (b, PROMPTS[2][:20])])
        step = h.extend(model, [(a, [7]), (b, [8])])
        logits = model.compute_logits(torch.cat([first, step])).numpy()
    return logits, [s.num_kv_heads for s in model.kv_shapes]


def rank_tokens(rank: int, ckpts: dict, device: str) -> dict:
    """Only the engine cases (the GPU test)."""
    return {case: engine_tokens(ckpts[m], ckpts[d] if d else None, device) for case, (m, d) in ENGINE_CASES.items()}


ENGINE_CASES = {"llama": ("llama", None), "qwen3": ("qwen3", None), "gemma4": ("gemma4", None),
                "gemma4-mtp": ("gemma4", "assistant"), "gemma4-mtp-ordered": ("gemma4", "assistant_ordered"),
                "qwen3-moe": ("qwen3_moe", None), "gemma4-moe-mtp": ("gemma4_moe", "assistant_moe")}


LOGIT_CASES = ("llama", "qwen3", "gemma4", "llama_bias_tied", "gemma4_ple_shared", "qwen3_moe", "gemma4_moe",
               "llama_fp8_block", "llama_fp8_tensor", "qwen3_moe_fp8_block")


def rank_workload(rank: int, ckpts: dict) -> dict:
    """Everything a rank computes for the TP tests (one spawn serves them all)."""
    from tests.helpers import tp_layers

    return {
        "layers": tp_layers.check_layers(),
        "logits": {k: model_logits(ckpts[k]) for k in LOGIT_CASES},
        "tokens": rank_tokens(rank, ckpts, "cpu"),
    }
