"""Drive model forwards over a real KV pool and paged attention backend, without the worker.

``PagedHarness`` owns a KVPool, a page table and a backend. Pages are handed out in a shuffled
order so page addressing bugs show up, and page 0 / page-table row 0 stay padding as in the
worker. Typical use::

    h = PagedHarness(model.kv_shapes, model.sliding_windows, page_size=4)
    a, b = h.new_slot(), h.new_slot()
    hidden = h.extend(model, [(a, [5, 6, 7]), (b, [9, 10])])   # [5, H]; rows back to back
    hidden = h.extend(model, [(a, [8]), (b, [11])])             # a decode step for both
    fb = h.draft_batch([a, b])                                   # Q-only, frozen-KV convention
"""

from __future__ import annotations

import os

import numpy as np
import torch

from gpu_worker.attention import create_backend
from gpu_worker.attention.base import RowLayout
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.kv_pool import KVLayerShape, KVPool

# The model tests run on CPU in CI; TANDEM_TEST_DEVICE=cuda runs the same checks on a GPU.
TEST_DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")


class PagedHarness:
    def __init__(
        self,
        kv_shapes: list[KVLayerShape],
        windows: tuple[int, ...] = (),
        *,
        page_size: int = 4,
        num_pages: int = 96,
        max_slots: int = 8,
        max_pages_per_slot: int = 32,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = TEST_DEVICE,
        backend: str = "torch",
        seed: int = 0,
    ):
        self.device = torch.device(device)
        self.page_size = page_size
        self.windows = tuple(windows)
        self.pool = KVPool(list(kv_shapes), num_pages, page_size, dtype, self.device)
        self.page_table = torch.zeros(max_slots + 1, max_pages_per_slot, dtype=torch.int32, device=self.device)
        self.backend = create_backend(backend, pool=self.pool, page_table=self.page_table)
        rng = np.random.default_rng(seed)
        self.free_pages = [int(p) for p in rng.permutation(np.arange(1, num_pages))]
        self.free_slots = list(range(1, max_slots + 1))
        self.seq_len: dict[int, int] = {}
        self.pages: dict[int, list[int]] = {}

    # ---- slots and pages ----------------------------------------------------------------

    def new_slot(self) -> int:
        slot = self.free_slots.pop(0)
        self.seq_len[slot], self.pages[slot] = 0, []
        return slot

    def ensure_capacity(self, slot: int, length: int) -> None:
        while len(self.pages[slot]) * self.page_size < length:
            page = self.free_pages.pop()
            self.page_table[slot, len(self.pages[slot])] = page
            self.pages[slot].append(page)

    def locations(self, slot: int, positions: np.ndarray) -> np.ndarray:
        table = np.asarray(self.pages[slot], dtype=np.int64)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    # ---- batches ------------------------------------------------------------------------

    def build(
        self,
        slots: list[int],
        q_lens: list[int],
        positions: np.ndarray,
        q_pos: np.ndarray,
        kv_lens: list[int],
        out_loc: np.ndarray | None,
        input_ids: np.ndarray | None,
    ) -> ForwardBatch:
        dev = self.device
        layout = RowLayout(
            slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            q_lens=np.asarray(q_lens, dtype=np.int64),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int64, device=dev),
            kv_bound=np.asarray(kv_lens, dtype=np.int64),
            q_pos=torch.as_tensor(q_pos, dtype=torch.int64).to(dev),
        )
        meta = self.backend.build(layout, self.windows)
        return ForwardBatch(
            input_ids=None if input_ids is None else torch.as_tensor(input_ids, dtype=torch.int64).to(dev),
            positions=torch.as_tensor(positions, dtype=torch.int64).to(dev),
            out_loc=None if out_loc is None else torch.as_tensor(out_loc, dtype=torch.int64).to(dev),
            attn=meta,
            num_tokens=int(sum(q_lens)),
        )

    def extend_batch(self, rows: list[tuple[int, list[int]]]) -> ForwardBatch:
        """Target batch: each row appends its tokens at the slot's current length (prefill
        chunk, decode or verify alike). Advances the slots' lengths."""
        slots, q_lens, kv_lens, pos, locs, ids = [], [], [], [], [], []
        for slot, tokens in rows:
            start, n = self.seq_len[slot], len(tokens)
            self.ensure_capacity(slot, start + n)
            p = np.arange(start, start + n, dtype=np.int64)
            slots.append(slot)
            q_lens.append(n)
            kv_lens.append(start + n)
            pos.append(p)
            locs.append(self.locations(slot, p))
            ids.append(np.asarray(tokens, dtype=np.int64))
            self.seq_len[slot] = start + n
        positions = np.concatenate(pos)
        return self.build(slots, q_lens, positions, positions, kv_lens, np.concatenate(locs), np.concatenate(ids))

    def extend(self, model, rows: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run the target over ``rows``; returns post-norm hidden [T, H] for every token."""
        return model.forward(self.extend_batch(rows), self.backend)

    def draft_batch(self, slots: list[int], rope_position_offset: int = 0) -> ForwardBatch:
        """Frozen-KV draft batch, one query per slot: it sees exactly the slot's committed keys
        (q_pos = kv_len - 1); its RoPE position is committed_len + ``rope_position_offset``
        (HF's reference uses the bonus token's index, i.e. offset 0)."""
        kv_lens = [self.seq_len[s] for s in slots]
        q_pos = np.asarray(kv_lens, dtype=np.int64) - 1
        positions = np.asarray(kv_lens, dtype=np.int64) + rope_position_offset
        return self.build(slots, [1] * len(slots), positions, q_pos, kv_lens, None, None)

    @staticmethod
    def last_rows(rows: list[tuple[int, list[int]]]) -> list[int]:
        """Indices (into the flat token dim) of each row's last token."""
        ends = np.cumsum([len(t) for _, t in rows]) - 1
        return [int(e) for e in ends]


# --------------------------------------------------------------------------- HF oracle helpers


def randomize_hf_(model: torch.nn.Module, seed: int = 0) -> None:
    """Give a freshly built HF model weights that exercise every term: O(1) activations
    (std 1/sqrt(fan_in) matrices), norm weights and layer scalars away from 1, non-zero biases.
    HF's own init (std 0.02, unit norms) would make most logits ~0 and hide bugs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name or "embed_scale" in name:
                continue
            if t.ndim >= 2:
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
            elif "norm" in name or name.endswith("layer_scalar"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)


def hf_logits(model, ids) -> torch.Tensor:
    """HF logits [L, V] (float32) for one unpadded sequence."""
    with torch.inference_mode():
        out = model(input_ids=torch.as_tensor([list(ids)], dtype=torch.int64), use_cache=False)
    return out.logits[0].float()
