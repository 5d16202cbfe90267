"""Mixture-of-experts blocks: the routers and the experts' weights, as HF names them.

The interface every MoE model uses:
- a router maps the hidden states [T, H] to ``(ids [T, K] int32, weights [T, K] float32)``:
  ``SoftmaxRouter`` (Qwen3-MoE's ``mlp.gate``) and ``Gemma4Router`` (Gemma 4's ``router``);
- ``Experts`` (``experts``) maps ``(x [T, H], ids, weights)`` to
  ``sum_k weights[:, k] * down_e(act(gate_e(x)) * up_e(x))`` with ``e = ids[:, k]``, in the
  model dtype, all-reduced over the tensor-parallel ranks (each holds every expert's slice of
  the intermediate dimension, as the dense MLP is split).

Arithmetic (HF's, in the model dtype DT): each expert's ``gate_up`` output is rounded to DT,
``act(gate)`` rounded, the product rounded, ``down`` rounded, times the slot's float32 weight,
rounded; Qwen3-MoE's weights are first rounded to DT (HF casts them), Gemma 4's are not. The
torch path sums the slots as HF does (expert by expert, in DT); the kernel path
(``kernels/moe*.py``) sums them in float32 and rounds once.

Checkpoints hold the experts in either of two layouts, both loaded (``models/loader.py``): HF's
fused 3-D tensors (``experts.gate_up_proj [E, 2I, H]``, gate rows first, and
``experts.down_proj [E, H, I]``) and per-expert modules (``experts.N.gate_proj.weight [I, H]``,
``up_proj``, ``down_proj [H, I]``). FP8 experts (a quantized checkpoint's, or ``--quantization
fp8``) keep both stacks in e4m3 with their scales (``quant/fp8_experts.py``); the kernels read
them as e4m3, the torch path dequantizes the experts a step hits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.kernels import use_triton
from gpu_worker.kernels.gemv import linear
from gpu_worker.kernels.moe import fused_experts
from gpu_worker.kernels.moe_route import ROUTER_MAX_TOKENS, route_topk, router_topk
from gpu_worker.models.moe_config import MoESpec
from gpu_worker.models.layers import GemmaRMSNorm, activation
from gpu_worker.parallel import shard
from gpu_worker.parallel.comm import all_reduce
from gpu_worker.parallel.shard import Rows
from gpu_worker.parallel.state import tp_size

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool, expert_scale: torch.Tensor | None,
                    round_to: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's routing: float32 softmax, top-k, [renormalise], [round to ``round_to``], [times the
    per-expert scale] -> (ids int32, weights float32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_to is not None:
        weights = weights.to(round_to).float()
    if expert_scale is not None:
        weights = weights * expert_scale[ids]
    return ids.to(torch.int32), weights


def route(x: torch.Tensor, weight: torch.Tensor, spec: MoESpec, expert_scale: torch.Tensor | None,
          round_to: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of x [T, H] through the router's ``weight`` [E, H] (logits in x's dtype). On
    the kernel path 1-4 tokens take one launch for the projection and the routing
    (``router_topk``: decode graphs keep one kernel, not a cuBLAS call that would break their PDL
    chain, and a routing kernel); more take the projection, then the routing kernel."""
    if use_triton(x) and 1 <= x.shape[0] <= ROUTER_MAX_TOKENS and x.stride(1) == 1:
        return router_topk(x, weight, spec.top_k, spec.renormalize, expert_scale, round_to is not None)
    logits = linear(x, weight)
    if use_triton(logits):
        return route_topk(logits, spec.top_k, spec.renormalize, expert_scale, round_to is not None)
    return route_reference(logits, spec.top_k, spec.renormalize, expert_scale, round_to)


class SoftmaxRouter(nn.Module):
    """Qwen3-MoE's ``mlp.gate``: logits = x @ weight^T in the model dtype; the weights of the
    chosen experts are rounded to it (HF casts them back)."""

    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.weight, self.spec, None, x.dtype)


class Gemma4Router(nn.Module):
    """Gemma 4's ``router``: its input is the residual stream, RMS-normed without a weight, times
    ``scale`` and 1/sqrt(hidden) (each product rounded to the model dtype, as HF); its weights
    are renormalised, then times ``per_expert_scale`` (float32)."""

    def __init__(self, hidden: int, spec: MoESpec, eps: float):
        super().__init__()
        self.spec = spec
        self.root = hidden**-0.5
        self.norm = GemmaRMSNorm(hidden, eps, with_scale=False)
        self.proj = nn.Linear(hidden, spec.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(spec.num_experts))

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * self.scale * self.root

    def route(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing from the router input ``r`` (``inputs(x)``, or its fused kernel)."""
        return route(r, self.proj.weight, self.spec, self.per_expert_scale, None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route(self.inputs(x))


class Experts(nn.Module):
    """Every expert's gated MLP, this rank's slice of the intermediate dimension:
    ``gate_up_proj [E, 2i, H]`` (gate rows, then up rows) and ``down_proj [E, H, i]``; with
    ``quant`` (FP8) both in e4m3 beside their scales."""

    quantizable_experts = True
    quant = None  # Fp8ExpertsMethod once made FP8

    def __init__(self, hidden: int, spec: MoESpec, act: str):
        super().__init__()
        self.num_experts = spec.num_experts
        self.rows: Rows = shard.even(spec.intermediate_size, "moe_intermediate_size")
        i = self.rows.size
        self.gate_up_proj = nn.Parameter(torch.empty(spec.num_experts, 2 * i, hidden))
        self.down_proj = nn.Parameter(torch.empty(spec.num_experts, hidden, i))
        self.act_name = act
        activation(act)  # fail at build time on an unsupported activation

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            out = fused_experts(x, self.gate_up_proj, self.down_proj, ids, weights, self.act_name,
                                scales=self._scales())
        else:
            out = self._reference(x, ids, weights)
        return all_reduce(out)

    def gives_slots(self, x: torch.Tensor) -> bool:
        """Whether ``slots`` serves ``x``: the kernel path on one rank (under TP the all-reduce
        comes between the slots' sum and whatever follows)."""
        return tp_size() == 1 and use_triton(x)

    def slots(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each slot's weighted expert output [T*K, H] unsummed (slot k of token t at row t*K + k),
        for a caller that fuses the sum into its next kernel (where ``gives_slots``)."""
        assert self.gives_slots(x)
        return fused_experts(x, self.gate_up_proj, self.down_proj, ids, weights, self.act_name, sum_slots=False,
                             scales=self._scales())

    def _scales(self):
        return None if self.quant is None else self.quant.scales(self)

    def _expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s (gate_up [2i, H], down [H, i]) weights in ``dtype``."""
        if self.quant is None:
            return self.gate_up_proj[e], self.down_proj[e]
        return self.quant.dequantized(self, e, dtype)

    def _reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """HF's eager loop: expert by expert in id order, each slot's output added in the model
        dtype (the CPU path; it reads which experts were hit on the host)."""
        out = torch.zeros_like(x)
        act = activation(self.act_name)
        ids = ids.long()
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            gate_up, down = self._expert(e, x.dtype)
            gate, up = F.linear(x[token], gate_up).chunk(2, dim=-1)
            y = F.linear(act(gate) * up, down) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    # ---- loading ------------------------------------------------------------------------

    def expert_view(self, index: int, proj: str) -> torch.Tensor:
        """Where the per-expert checkpoint tensor ``experts.<index>.<proj>.weight`` goes."""
        i = self.rows.size
        if proj == "gate_proj":
            return self.gate_up_proj[index, :i]
        if proj == "up_proj":
            return self.gate_up_proj[index, i:]
        return self.down_proj[index]

    def checkpoint_shard(self, leaf: str, src: torch.Tensor, part: str | None = None) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor: fused (``leaf`` = ``gate_up_proj`` /
        ``down_proj``, 3-D) or one expert's (``part`` = its projection, ``leaf`` = ``weight``)."""
        if tp_size() == 1:
            return src
        r, full = self.rows, self.rows.full
        if part in ("gate_proj", "up_proj"):
            return src.narrow(0, r.start, r.size)
        if part == "down_proj":
            return src.narrow(1, r.start, r.size)
        if leaf == "gate_up_proj":
            return torch.cat([src.narrow(1, r.start, r.size), src.narrow(1, full + r.start, r.size)], dim=1)
        return src.narrow(2, r.start, r.size)


class Slots(NamedTuple):
    """A MoE block's output left unsummed: each slot's weighted expert output [T*K, H] (slot k of
    token t at row t*K + k); the residual add that follows sums them in its own kernel."""

    rows: torch.Tensor
    top_k: int


class SparseMoE(nn.Module):
    """Qwen3-MoE's MLP of a sparse layer (``mlp``): ``gate`` (the router) and ``experts``. Where
    the experts give per-slot outputs (kernel path, one rank) it returns them as ``Slots``."""

    def __init__(self, hidden: int, spec: MoESpec, act: str):
        super().__init__()
        self.gate = SoftmaxRouter(hidden, spec)
        self.experts = Experts(hidden, spec, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor | Slots:
        ids, weights = self.gate(x)
        if self.experts.gives_slots(x):
            return Slots(self.experts.slots(x, ids, weights), ids.shape[1])
        return self.experts(x, ids, weights)
