"""The in-process engine for engine tests (``tandem/inproc.py``: the scheduler core and the
worker's runner in one process, no sockets), plus what tests read from its outputs."""

from __future__ import annotations

import numpy as np

from tandem.inproc import InProcEngine, _dec_plan, _dec_result, _enc  # noqa: F401 - re-exported for tests


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
