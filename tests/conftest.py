"""Session-wide set-up shared by every test directory.

Without CUDA, our Triton kernels run under Triton's interpreter (numpy on the CPU), so the kernel
tests and the ``--attention-backend triton`` parity tests run in CI. The variable must be set
before any kernel module is imported: ``triton.jit`` reads it when it decorates.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
