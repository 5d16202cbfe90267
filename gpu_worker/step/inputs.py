"""A step's inputs, one type per path, built on the host and sent to the device in one copy.

- ``GraphStep``: a decode-only step whose batch fits a graph bucket. It replays the bucket's
  CUDA graphs (``graphs/decode.py``): plain decode, or MTP's draft loop then its verify. Its
  tokens, positions and KV locations come from per-slot device state, so it uploads at most the
  bucket's slot ids (nothing when the bucket already holds them) and a backend's graph plan.
- ``EagerStep``: every other step (prefill chunks, alone or beside decode rows; decode without
  graphs): one forward over a flat batch (``batch.py``: extend rows' chunks, then T tokens per
  decode row), eager or through the piecewise prefill graphs (``graphs/prefill.py``).

Both carry ``StepInputs``' fields: the plan's rows and the slot-state rows the step writes
(admitted requests' sampling and processor parameters, page-table appends). Fields declared
``staged()`` are numpy arrays until ``Upload.send`` and device tensors after
(``gpu_worker/upload.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.step.batch import PlanRows, logits_rows
from gpu_worker.step.processors import ProcessorRows
from gpu_worker.step.slots import AdmittedRows, PageWrites
from gpu_worker.upload import staged


@dataclass(kw_only=True)
class StepInputs:
    step_id: int
    rows: PlanRows
    admitted: AdmittedRows | None = staged(default=None)
    processors: ProcessorRows | None = staged(default=None)
    pages: PageWrites | None = staged(default=None)
    # Only when a result row asks for logprobs: where each logits row goes in the [R * T] layout
    # of the result (one row per sampled extend row, T per decode row).
    logprob_rows: torch.Tensor | None = staged(default=None)


@dataclass(kw_only=True)
class GraphStep(StepInputs):
    bucket: int
    padded: np.ndarray  # host: the bucket's slot ids, rows past the batch 0 (the padding slot)
    slots: torch.Tensor | None = staged(default=None)  # ``padded``, unless the bucket holds it already
    attn: object | None = staged(default=None)  # the backend's graph plan (``stage_graph``)


@dataclass
class ExtendRows:
    """The step's prefill chunks, row after row."""

    ids: torch.Tensor = staged()  # [N_ext] their tokens
    pos: torch.Tensor = staged()  # [N_ext] their positions
    kv_len: torch.Tensor = staged()  # [E] each row's KV length once its chunk is written


@dataclass
class SampledRows:
    """The extend rows that sample (their prompt's last chunk)."""

    slots: torch.Tensor = staged()
    pos: torch.Tensor = staged()  # the position of the token each samples


@dataclass(kw_only=True)
class EagerStep(StepInputs):
    ext: ExtendRows = staged()
    slots: torch.Tensor = staged()  # [E + D] the extend rows' slots, then the decode rows'
    tok_slot: torch.Tensor = staged()  # [N] each token's slot
    logit_rows: torch.Tensor = staged()  # the tokens whose logits are sampled (``batch.logits_rows``)
    result_slots: torch.Tensor = staged()  # [R] the result rows' slots
    sampled: SampledRows | None = staged(default=None)
    attn: object | None = staged(default=None)  # the backend's forward plan (``stage``)


def logprob_rows(rows: PlanRows, t: int, wanted: bool) -> np.ndarray | None:
    """``StepInputs.logprob_rows`` when ``wanted``."""
    if not wanted:
        return None
    e = len(rows.sampled_ext_rows())
    return np.concatenate([np.arange(e) * t, e * t + np.arange(len(rows.dec_slots) * t)])


def graph_step(common: dict, bucket: int, graphs, backend, dec_kv: np.ndarray | None) -> GraphStep:
    """The slot ids go up only when the bucket's buffer does not hold them already (decode
    batches repeat step after step). ``dec_kv``: the rows' KV lengths after this step, where
    the host knows them (no MTP)."""
    rows: PlanRows = common["rows"]
    padded = np.zeros(bucket, dtype=np.int64)  # padding rows point at slot 0
    padded[: len(rows.dec_slots)] = rows.dec_slots
    held = graphs.holds(bucket, padded)
    return GraphStep(**common, bucket=bucket, padded=padded, slots=None if held else padded,
                     attn=backend.stage_graph(bucket, rows.dec_slots, dec_kv))


def eager_step(common: dict, t: int, backend, dec_kv: np.ndarray | None) -> EagerStep:
    rows: PlanRows = common["rows"]
    offsets = np.cumsum(rows.ext_len) - rows.ext_len
    slots = np.concatenate([rows.ext_slots, rows.dec_slots])
    q_lens = rows.q_lens(t)
    sampled = rows.sampled_ext_rows()
    dec = dec_kv if dec_kv is not None else np.full(len(rows.dec_slots), -1, dtype=np.int64)
    return EagerStep(
        **common,
        ext=ExtendRows(
            ids=rows.ext_tokens,
            pos=np.arange(rows.num_ext_tokens) + np.repeat(rows.ext_start - offsets, rows.ext_len),
            kv_len=rows.ext_start + rows.ext_len),
        slots=slots,
        tok_slot=np.repeat(slots, q_lens),
        logit_rows=logits_rows(rows, t),
        result_slots=rows.result_slots(),
        sampled=SampledRows(rows.ext_slots[sampled], (rows.ext_start + rows.ext_len)[sampled]) if len(sampled)
        else None,
        attn=backend.stage(q_lens, slots=slots, kv_exact=np.concatenate([rows.ext_start + rows.ext_len, dec])))
