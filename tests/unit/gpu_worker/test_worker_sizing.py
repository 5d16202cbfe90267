"""The GPU's KV budget (gpu_worker/sizing.py): what the weights leave of the memory fraction, less
a reserve for activations and the logits of the rows a step samples -- never of a whole prefill
chunk, which no step sends through the LM head (a 262k vocabulary would reserve ~26 GB)."""

from __future__ import annotations

import types

import torch

from common.args import ServerArgs
from gpu_worker.models.loader import load_model
from gpu_worker.sizing import plan_capacity
from tests.helpers.checkpoints import build_llama

GIB = 1 << 30


def test_a_large_vocabulary_leaves_room_for_the_kv_pool(tmp_path, monkeypatch):
    m = load_model(build_llama(str(tmp_path / "l")), torch.bfloat16, "cpu", load_format="dummy")
    target = types.SimpleNamespace(kv_shapes=m.kv_shapes, vocab_size=262144)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, 80 * GIB))  # 50 GiB of weights
    cuda = torch.device("cuda")
    small = plan_capacity(ServerArgs(model_path="x", chunked_prefill_size=512), target, cuda, torch.bfloat16, 4, 4096)
    large = plan_capacity(ServerArgs(model_path="x", chunked_prefill_size=16384), target, cuda, torch.bfloat16, 4,
                          4096)
    assert small.num_pages == large.num_pages > 1000  # the chunk size does not eat the pool
    fewer = plan_capacity(ServerArgs(model_path="x", max_running_requests=512), target, cuda, torch.bfloat16, 4, 4096)
    assert fewer.num_pages < small.num_pages  # more rows sampled at once: more logits reserved
