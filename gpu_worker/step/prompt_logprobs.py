"""Logprobs of prompt tokens (``echo`` + ``logprobs``, lm-eval's loglikelihood requests).

A rare path: it loops over the extend rows that asked for it and copies to the host
synchronously. The scheduler sends such prompts as one chunk with no prefix-cache hit, so the
row's own logits cover every prompt token after the first.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.step.sampling import token_logprobs
from proto.messages import Logprobs, PromptLogprobRows

BLOCK_ROWS = 1024  # prompt positions whose logits are materialised at once (sizing.py reserves for them)


def prompt_logprob_rows(target, rows, state, hidden: torch.Tensor) -> list[PromptLogprobRows]:
    want = state.prompt_logprobs[rows.ext_slots] if len(rows.ext_slots) else np.zeros(0)
    if not (want >= 0).any():
        return []
    offsets = np.cumsum(rows.ext_len) - rows.ext_len
    out = []
    for r in np.nonzero(want >= 0)[0]:
        lo, n = int(offsets[r]), int(rows.ext_len[r])
        if n < 2:  # a one-token prompt has no prompt logprobs: say so with an empty row, not silence
            empty = Logprobs(b"", b"", b"", int(want[r]))
            out.append(PromptLogprobRows(int(rows.ext_slots[r]), int(rows.ext_start[r]) + 1, empty))
            continue
        # Such a prompt is one chunk whatever its length (it bypasses the chunk budget the KV
        # sizing reserves logits memory for): materialising [n, vocab] fp32 logits plus their
        # log_softmax at once runs a long prompt on a large vocabulary out of device memory.
        parts = []
        for b in range(lo, lo + n - 1, BLOCK_ROWS):
            e = min(b + BLOCK_ROWS, lo + n - 1)
            logits = target.compute_logits(hidden[b:e])
            toks = torch.from_numpy(rows.ext_tokens[b + 1 : e + 1]).to(logits.device)
            parts.append([x if x is None else x.cpu() for x in token_logprobs(logits, toks, int(want[r]))])
        chosen = torch.cat([p[0] for p in parts])
        ids = None if parts[0][1] is None else torch.cat([p[1] for p in parts])
        vals = None if parts[0][2] is None else torch.cat([p[2] for p in parts])
        top = 0 if ids is None else ids.shape[-1]
        lp = Logprobs(
            chosen.float().numpy().tobytes(),
            b"" if ids is None else ids.numpy().tobytes(),
            b"" if vals is None else vals.float().numpy().tobytes(),
            top,
        )
        out.append(PromptLogprobRows(int(rows.ext_slots[r]), int(rows.ext_start[r]) + 1, lp))
    return out
