"""Logprobs of prompt tokens (``echo`` + ``logprobs``, lm-eval's loglikelihood requests).

A rare path: it loops over the extend rows that asked for it and copies to the host
synchronously. The scheduler sends such prompts as one chunk with no prefix-cache hit, so the
row's own logits cover every prompt token after the first.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.sampling import token_logprobs
from proto.messages import Logprobs, PromptLogprobRows


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
        logits = target.compute_logits(hidden[lo : lo + n - 1])
        toks = torch.from_numpy(rows.ext_tokens[lo + 1 : lo + n]).to(logits.device)
        chosen, ids, vals = token_logprobs(logits, toks, int(want[r]))
        top = 0 if ids is None else ids.shape[-1]
        lp = Logprobs(
            chosen.float().cpu().numpy().tobytes(),
            b"" if ids is None else ids.cpu().numpy().tobytes(),
            b"" if vals is None else vals.float().cpu().numpy().tobytes(),
            top,
        )
        out.append(PromptLogprobRows(int(rows.ext_slots[r]), int(rows.ext_start[r]) + 1, lp))
    return out
