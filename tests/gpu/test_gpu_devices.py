"""On a GPU machine, the supervisor's torch-free GPU count (common/devices.py) agrees with
torch's, so --device auto resolves to cuda and --device cuda:N is checked against the GPUs the
worker will see."""

from __future__ import annotations

import torch

from common.args import ServerArgs
from common.devices import check_cuda_device, cuda_devices


def test_driver_count_matches_torch():
    assert cuda_devices().count == torch.cuda.device_count() > 0
    assert ServerArgs(model_path="unused").resolved_device() == "cuda"
    n = torch.cuda.device_count()
    assert check_cuda_device(f"cuda:{n - 1}") is None
    assert "does not exist" in check_cuda_device(f"cuda:{n}")


def test_hidden_gpus_count_as_none(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda_devices().count == 0
