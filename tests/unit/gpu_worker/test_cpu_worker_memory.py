"""What keeps a CPU engine lean: the KV pool is sized to what the engine can use and resident only
where written; the worker's process keeps Triton and ``torch._dynamo`` out; the scheduler never
imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from gpu_worker.kv_pool import KVLayerShape, KVPool
from gpu_worker.sizing import CPU_DEFAULT_SLOTS, plan_capacity
from tests.helpers.server import ROOT

SHAPES = [KVLayerShape(2, 64)] * 4  # 2 KiB a token in float32


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def _args(**kw):
    base = dict(page_size=16, context_length=None, max_total_tokens=None, max_running_requests=None,
                chunked_prefill_size=None, mem_fraction_static=0.85)
    return SimpleNamespace(**{**base, **kw})


def test_the_cpu_pool_holds_every_running_request_at_full_context():
    target = SimpleNamespace(kv_shapes=SHAPES, vocab_size=100)
    t, ps = 4, 16
    slack = 2 * t + ps
    cap = plan_capacity(_args(max_running_requests=3), target, torch.device("cpu"), torch.float32, t, 1000)
    assert (cap.num_pages - 1) * ps >= 3 * (1000 + slack) and (cap.num_pages - 2) * ps < 3 * (1000 + slack)
    assert cap.max_slots == 3 and cap.max_context == 1000
    default = plan_capacity(_args(context_length=200), target, torch.device("cpu"), torch.float32, t, 1000)
    assert default.max_slots == CPU_DEFAULT_SLOTS
    assert (default.num_pages - 1) * ps >= CPU_DEFAULT_SLOTS * (200 + slack)
    # a context plus slack that is not a whole number of pages: the pool rounds up, never caps
    one = plan_capacity(_args(max_running_requests=1), target, torch.device("cpu"), torch.float32, 1, 4096)
    assert one.max_context == 4096 and one.num_pages - 1 == -(-(4096 + 2 + ps) // ps)


def test_the_cpu_pool_is_resident_only_where_written():
    before = _rss_mb()
    pool = KVPool(SHAPES, 12800, 16, torch.float32, "cpu")  # 400 MiB of capacity
    assert _rss_mb() - before < 20
    assert not pool.k[0][:64].any() and not pool.v[3][-64:].any()  # zeros, as a torch pool
    loc = torch.arange(5000)
    pool.write(0, loc, torch.ones(5000, 2, 64), torch.ones(5000, 2, 64))  # ~5 MB written
    assert 2 < _rss_mb() - before < 30
    assert pool.k[0][:5000].sum() == 5000 * 128


def _run(code: str, env: dict | None = None) -> str:
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def test_a_cpu_worker_keeps_triton_and_dynamo_out(ckpts):
    out = _run(
        "import sys, torch\n"
        "from gpu_worker.models.loader import load_model\n"
        "import gpu_worker.main\n"
        f"load_model({ckpts['gemma4']!r}, torch.float32, torch.device('cpu'), 'auto')\n"
        "print(sys.modules.get('triton', 'absent'), 'torch._dynamo' in sys.modules)\n")
    assert out.split() == ["None", "False"]


def test_the_scheduler_process_never_imports_torch():
    assert _run("import sys\nimport scheduler_proc.main\nprint('torch' in sys.modules)\n").strip() == "False"
