"""A test-only draft model that proposes from a bigram table of known target continuations.

Random tiny checkpoints give a random assistant almost no acceptance, which would leave the
multi-token paths (partial acceptance, finishing mid-chunk, page growth by several tokens)
untested. This stand-in has the assistant's interface and accepts often; losslessness must
not depend on it being right.
"""

from __future__ import annotations

import torch
from torch import nn


class BigramDraft(nn.Module):
    sliding_windows: tuple[int, ...] = ()

    def __init__(self, target, table: dict[int, int]):
        super().__init__()
        self.target = target
        self.hidden_size = target.hidden_size
        v = target.vocab_size
        nxt = torch.arange(v)
        for a, b in table.items():
            nxt[a] = b
        self.register_buffer("next_tok", nxt)

    def draft_step(self, tokens, prev_hidden, fb, backend, out=None, last=False):
        """The engine's interface (``Gemma4AssistantForCausalLM.draft_step``): next tokens (into
        ``out`` when given), hidden (None for a chain's ``last`` step)."""
        nxt = self.next_tok[tokens]
        return (nxt if out is None else out.copy_(nxt)), None if last else prev_hidden

def bigram_table(sequences: list[list[int]]) -> dict[int, int]:
    table: dict[int, int] = {}
    for seq in sequences:
        for a, b in zip(seq, seq[1:]):
            table.setdefault(a, b)
    return table
