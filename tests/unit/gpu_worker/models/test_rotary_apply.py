"""A move that moves nothing keeps every tensor of a loaded model where it is.

CUDA graphs hold raw addresses. ``Rotary._apply`` used to give ``inv_freq`` a new tensor on every
``.to()`` / ``.cuda()``, where PyTorch keeps any parameter or buffer already on the right device
in the right dtype: a model moved to where it already was (the oracle draft's ``.cuda()`` moves
the target, its submodule) left the piecewise prefill graphs reading a freed tensor, and tokens
went wrong from the first one (tests/gpu/test_gpu_mtp_accept.py, "recapture"). The CPU twin:
addresses before and after such moves, and the frequencies still exact after the moves that do
change the buffer (a dtype cast, ``to_empty``).
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.models.layers import Rotary, rope_inv_freq
from gpu_worker.models.loader import load_model
from tests.helpers.checkpoints import build_assistant, build_gemma4, build_llama


def _addresses(model: torch.nn.Module) -> dict[str, int]:
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return {name: t.data_ptr() for name, t in tensors.items()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rotary_apply")
    g = build_gemma4(str(root / "g"))
    return {"llama": build_llama(str(root / "l")), "gemma4": g, "assistant": build_assistant(str(root / "a"), g)}


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_a_move_to_where_the_model_is_keeps_every_tensor(ckpts, arch):
    model = load_model(ckpts[arch], torch.float32, "cpu")
    before = _addresses(model)
    assert any(name.endswith("inv_freq") for name in before)  # the buffer this is about
    model.to("cpu")
    model.float()
    model.to(torch.device("cpu"), torch.float32)
    assert _addresses(model) == before


def test_the_draft_moved_with_its_target_keeps_the_target_in_place(ckpts):
    """The oracle draft's pattern: a module that owns the target as a submodule, moved again."""
    target = load_model(ckpts["gemma4"], torch.float32, "cpu")
    draft = load_model(ckpts["assistant"], torch.float32, "cpu", target=target)
    before = _addresses(target)
    holder = torch.nn.Module()
    holder.target, holder.draft = target, draft
    holder.to("cpu")
    assert _addresses(target) == before


@pytest.mark.parametrize("rope_type", ["default", "proportional"])
def test_the_frequencies_stay_float32_and_exact_through_casts(rope_type):
    from gpu_worker.models.config import RopeSpec

    spec = RopeSpec(theta=10000.0, rope_type=rope_type, partial_rotary_factor=0.25 if rope_type == "proportional" else 1.0)
    rot = Rotary(32, spec)
    exact = rope_inv_freq(32, spec)
    rot.to(torch.bfloat16)  # a dtype cast: a new float32 tensor with the exact values
    assert rot.inv_freq.dtype == torch.float32 and torch.equal(rot.inv_freq, exact)
    ptr = rot.inv_freq.data_ptr()
    rot.inv_freq.fill_(0.0)  # what to_empty() may leave: the values are recomputed in place
    rot.to("cpu")
    assert rot.inv_freq.data_ptr() == ptr and torch.equal(rot.inv_freq, exact)
    rot.to_empty(device="cpu")
    assert rot.inv_freq.dtype == torch.float32 and torch.equal(rot.inv_freq, exact)
