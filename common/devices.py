"""How many CUDA GPUs this process could use, found without importing torch.

The supervisor checks ``--device cuda`` and hands GPUs to ``--dp-size`` engines before any
worker starts, and it runs no model: importing torch there would cost ~200 MB and seconds. Two
facts answer the question instead: the installed torch is a CUDA build (its version carries no
``+cpu`` tag), and the NVIDIA driver (``libcuda.so.1``) initialises and counts the devices
``CUDA_VISIBLE_DEVICES`` leaves visible. ``ServerArgs.resolved_device`` (``--device auto``)
asks the same question, so the supervisor and the worker agree.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CudaDevices:
    count: int
    why_none: str = ""  # when count is 0: the reason, for an error line


def cuda_devices() -> CudaDevices:
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return CudaDevices(0, "torch is not installed")
    local = version.partition("+")[2]
    if local and not local.startswith("cu"):
        return CudaDevices(0, f"the installed torch {version} is not a CUDA build")
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return CudaDevices(0, "CUDA_VISIBLE_DEVICES hides every GPU")
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return CudaDevices(0, "no NVIDIA driver (libcuda.so.1) on this machine")
    if libcuda.cuInit(0) != 0:
        return CudaDevices(0, "the NVIDIA driver found no usable GPU (cuInit failed)")
    count = ctypes.c_int(0)
    if libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return CudaDevices(0, "the NVIDIA driver reports no GPU")
    return CudaDevices(count.value)


def check_cuda_device(device: str) -> str | None:
    """Why ``device`` (cuda or cuda:N) cannot run here, or None when it can."""
    found = cuda_devices()
    if found.count == 0:
        return f"no CUDA GPU is usable here: {found.why_none} (use --device cpu)"
    index = int(device[5:]) if device.startswith("cuda:") else 0
    if index >= found.count:
        return f"GPU {index} does not exist: {found.count} visible (CUDA_VISIBLE_DEVICES counts from 0)"
    return None
