"""The compiled CPU decode step's programs: ``DecodeBody``'s draft, target and greedy tail as
functions of their state tensors, exported once and compiled ahead of time by AOTInductor.

Each program takes the same leading inputs, in this order (``step_inputs``):

    slots [B], tokens [B, T], kv_cols [K], seq_len [S], last_token [S], hidden [S, H],
    page_table [S, P], the pool's K tensors, then its V tensors ([N, h, d] each)

and the tail also ``hidden_rows [B*T, H]``, ``logits [B*T, V]``, ``result [B, T+1]``. Every size
but the model's own is symbolic (batch, key bound, slots, pages, pool tokens), so one program
serves every batch size, context length and pool size. State is updated in place, as on the
GPU path: the draft writes ``tokens``; the target writes the KV of its tokens (and, without an
assistant, the bonus into ``tokens[:, 0]``) and returns ``(hidden, logits)``; the tail updates
``seq_len``, ``last_token``, ``hidden`` and writes ``result``.

The models' weights and buffers are the programs' constants, kept out of the package and bound
at load time to the worker's own tensors (``cpu_steps.py``): a package depends on the model's
shapes, never on its weights.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from gpu_worker.graphs.cpu_attention import CpuDecodeAttention
from gpu_worker.graphs.decode import DecodeBody

PROGRAMS = ("draft", "target", "tail")
TAIL_EXTRA = 3  # hidden_rows, logits, result


def step_inputs(slots, tokens, kv_cols, state, pool) -> list[torch.Tensor]:
    """The leading inputs every program takes, in order."""
    return [slots, tokens, kv_cols, state.seq_len, state.last_token, state.hidden, state.page_table,
            *pool.k, *pool.v]


@contextlib.contextmanager
def _bound(body: DecodeBody, attention: CpuDecodeAttention, inputs: tuple[torch.Tensor, ...]):
    """While a program is traced, the body's state and pool are the program's inputs."""
    _, _, kv_cols, seq_len, last_token, hidden, page_table, *kv = inputs
    st, pool = body.state, attention.pool
    n = len(pool.k)
    saved = (st.seq_len, st.last_token, st.hidden, st.page_table, pool.k, pool.v, attention.page_table)
    st.seq_len, st.last_token, st.hidden, st.page_table = seq_len, last_token, hidden, page_table
    pool.k, pool.v = list(kv[:n]), list(kv[n : 2 * n])
    attention.page_table, attention.kv_cols = page_table, kv_cols
    try:
        yield
    finally:
        (st.seq_len, st.last_token, st.hidden, st.page_table, pool.k, pool.v, attention.page_table) = saved
        attention.kv_cols = None


class StepProgram(nn.Module):
    """One of ``PROGRAMS`` as a module to export; the models are submodules (their weights the
    constants, named ``target.*`` and ``assistant.*``)."""

    def __init__(self, name: str, body: DecodeBody, attention: CpuDecodeAttention):
        super().__init__()
        assert name in PROGRAMS, name
        self.name = name
        self.target = body.target
        if body.assistant is not None:
            self.assistant = body.assistant
        self._body, self._attention = [body], [attention]  # lists: not submodules

    def forward(self, *inputs: torch.Tensor):
        body, attention = self._body[0], self._attention[0]
        n_kv = 2 * len(attention.pool.k)
        common = inputs[: 7 + n_kv]
        slots, tokens = common[0], common[1]
        with _bound(body, attention, common):
            if self.name == "draft":
                body.draft(slots, tokens)
                return ()
            if self.name == "target":
                return body.forward(slots, tokens)
            hidden_rows, logits, result = inputs[7 + n_kv :]
            body.tail(slots, tokens, hidden_rows, logits, result)
            return ()


def dynamic_shapes(name: str, n_kv: int, t: int):
    """The symbolic sizes of ``name``'s inputs (``torch.export`` dims)."""
    from torch.export import Dim

    batch, keys = Dim("batch", min=1, max=4096), Dim("keys", min=1, max=1 << 22)
    slots, pages, tokens = Dim("slots", min=2, max=1 << 16), Dim("pages", min=1, max=1 << 16), Dim("pool", min=2)
    shapes = [{0: batch}, {0: batch}, {0: keys}, {0: slots}, {0: slots}, {0: slots}, {0: slots, 1: pages}]
    shapes += [{0: tokens}] * n_kv
    if name == "tail":
        shapes += [{0: batch * t}, {0: batch * t}, {0: batch}]
    return {"inputs": tuple(shapes)}


def example_inputs(name: str, body: DecodeBody, attention: CpuDecodeAttention) -> list[torch.Tensor]:
    """Inputs to trace ``name`` with: two rows (a size of 0 or 1 would be specialised) and every
    symbolic size distinct from the others (the state's slot and page counts must differ)."""
    st, pool, t = body.state, attention.pool, body.t
    assert st.page_table.shape[0] != st.page_table.shape[1], "slots and pages must differ to trace"
    slots = torch.tensor([1, 2], dtype=torch.int64)
    tokens = torch.zeros(2, t, dtype=torch.int64)
    inputs = step_inputs(slots, tokens, torch.arange(3 * pool.page_size), st, pool)
    if name == "tail":
        with torch.no_grad():
            logits = body.target.compute_logits(torch.zeros(2 * t, st.hidden.shape[1], dtype=st.hidden.dtype))
        inputs += [torch.zeros(2 * t, st.hidden.shape[1], dtype=st.hidden.dtype), torch.zeros_like(logits),
                   torch.zeros(2, t + 1, dtype=torch.int32)]
    return inputs
