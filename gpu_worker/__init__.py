"""The GPU-worker process package (``gpu_worker.main.run``).

Without a CUDA device, none of our kernels runs in Triton unless its interpreter is asked for
(``TRITON_INTERPRET=1``: the kernel tests): every kernel module then takes its torch path, as on
an install without Triton. So such a process keeps the package out (``import triton`` raises
ImportError here), which saves the worker about 70 MB and a second of start-up.
"""

import sys

import torch

from gpu_worker.settings import triton_interpreting

if "triton" not in sys.modules and not triton_interpreting() and not torch.cuda.is_available():
    sys.modules["triton"] = None  # an ImportError for every later ``import triton``
