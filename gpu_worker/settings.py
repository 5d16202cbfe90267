"""The worker's development settings: the only environment variables ``gpu_worker`` reads.

None of them changes what the engine computes for a user; operator choices are flags
(``ServerArgs``). Each is read once, when the worker builds its runner (``DevSettings.from_env``),
except Triton's own interpreter switch, which Triton itself reads when a kernel launches.

| variable | effect |
|---|---|
| ``TANDEM_EMULATE_CUDA_GRAPHS=1`` | off CUDA, decode and prefill steps take the graph paths (padded bucket buffers, slot-0 padding rows) eagerly: the CPU twin of the CUDA graphs that CI tests |
| ``TANDEM_HOST_TIMING=1`` | the worker logs its host milliseconds per step by loop phase, every 200 steps |
| ``TANDEM_LOG_COMPILES=1`` | once ready, the worker logs every Triton kernel variant compiled (or loaded from Triton's cache) while serving, with its cost |
| ``TRITON_INTERPRET=1`` | Triton's interpreter: kernels run on CPU tensors (the kernel tests; ``--attention-backend triton`` on the CPU) |

The build of the compiled CPU steps (``graphs/cpu_build.py``) also reads the compiler's own
variables: ``TORCHINDUCTOR_CACHE_DIR`` (where builds are cached, as for all of Inductor) and
``CXX`` (the C++ compiler, else ``g++`` / ``clang++`` on ``PATH``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "0") not in ("", "0")


@dataclass(frozen=True)
class DevSettings:
    emulate_cuda_graphs: bool = False
    host_timing: bool = False
    log_compiles: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "DevSettings":
        env = os.environ if env is None else env
        return cls(emulate_cuda_graphs=_flag(env, "TANDEM_EMULATE_CUDA_GRAPHS"),
                   host_timing=_flag(env, "TANDEM_HOST_TIMING"),
                   log_compiles=_flag(env, "TANDEM_LOG_COMPILES"))


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, Triton's switch)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
