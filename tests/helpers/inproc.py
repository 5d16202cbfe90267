"""The in-process engine for engine tests (``tandem/inproc.py``: the scheduler core and the
worker's runner in one process, no sockets), plus what tests read from its outputs."""

from __future__ import annotations

import numpy as np

from gpu_worker.settings import DevSettings
from tandem import inproc
from tandem.inproc import _dec_plan, _dec_result, _enc  # noqa: F401 - re-exported for tests


class InProcEngine(inproc.InProcEngine):
    """On the CPU a test engine runs decode steps eagerly unless it asks for ``compiled`` ones
    (``graphs/cpu_steps.py``, as ``tandem serve`` runs by default: the first engine of a model
    shape builds them, a minute or two) or for the emulated CUDA-graph path."""

    def __init__(self, model_path: str, draft: str | None = None, *args, compiled: bool = False, **kw):
        if kw.get("device", "cpu") == "cpu" and not compiled and not DevSettings.from_env().emulate_cuda_graphs:
            kw.setdefault("disable_cuda_graph", True)
        super().__init__(model_path, draft, *args, **kw)


def top_alternatives(eng: InProcEngine, rid: str) -> list[dict[int, float]]:
    """Per generated token of ``rid`` (submitted with ``logprobs=k``): {token id: logprob} of its
    top-k alternatives — where two engines' tokens part, both choices should be a near-tie."""
    rows = []
    for out in eng.outputs[rid]:
        lp = out.logprobs
        if lp is None or not lp.top:
            continue
        ids = np.frombuffer(lp.top_ids, np.int32).reshape(-1, lp.top)
        vals = np.frombuffer(lp.top_logprobs, np.float32).reshape(-1, lp.top)
        rows += [dict(zip(i.tolist(), v.tolist())) for i, v in zip(ids, vals)]
    return rows
