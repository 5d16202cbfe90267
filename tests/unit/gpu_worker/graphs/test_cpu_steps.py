"""The compiled CPU decode steps (``graphs/cpu_steps.py``, built by ``graphs/cpu_build.py``) in the
in-process engine, MTP on: greedy tokens equal HF transformers' for batches of every size up to
the slot count, a batch goes from the greedy tail to the eager token selection and back (a
logprobs request joins and leaves) on one slot state, and ``--disable-cuda-graph`` turns the
path off. The draft runs in bfloat16 under the float32 target (as on a CPU with bfloat16
instructions: column-major weights, padded to a power of two from two rows, oneDNN off at one
row) and the outputs stay the target's; the programs' linears run their own few-row GEMM
(``graphs/cpu_ops.py``). The first run on a machine builds the tiny pair's programs (a minute
or two)."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_worker.graphs.cpu_attention import _work_dtype
from gpu_worker.graphs.cpu_steps import CpuDecodeSteps, draft_rows
from gpu_worker.main import draft_dtype
from gpu_worker.step.runner import ModelRunner
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.inproc import InProcEngine

pytestmark = pytest.mark.heavy  # minutes of work: started first (tests/conftest.py)

PROMPTS = [[(7 * j + 3 * i) % 370 + 6 for j in range(5 + 9 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def engine(ckpts):
    from gpu_worker import main

    with pytest.MonkeyPatch.context() as mp:  # the bfloat16 draft on every CPU (it is exact without the instructions)
        mp.setattr(main, "native_bf16", lambda: True)
        return InProcEngine(ckpts["gemma4"], draft=ckpts["assistant"], compiled=True, page_size=4,
                            chunked_prefill_size=24, max_running_requests=6)


def test_steps_are_compiled_and_the_flag_turns_them_off(engine, ckpts):
    assert isinstance(engine.runner.graphs, CpuDecodeSteps)
    off = InProcEngine(ckpts["gemma4"], draft=ckpts["assistant"], compiled=True, page_size=4, disable_cuda_graph=True)
    assert off.runner.graphs is None
    # a step with prefill rows would forgo the programs: prefill gets steps of its own there only
    assert not engine.ready.mixed_prefill and not engine.core.cfg.mixed_prefill
    assert off.ready.mixed_prefill and off.core.cfg.mixed_prefill


@pytest.mark.parametrize("n", [1, 2, 6])
def test_greedy_equals_hf_at_every_batch_size(engine, ckpts, n):
    new = 12
    for i in range(n):
        engine.submit(f"b{n}-{i}", PROMPTS[i], max_new_tokens=new + i, ignore_eos=True)
    engine.run()
    for i in range(n):
        assert engine.tokens[f"b{n}-{i}"] == hf_greedy(ckpts["gemma4"], PROMPTS[i], new + i, ignore_eos=True), i
    engine.core.alloc.check_all_free()


def test_tail_and_eager_selection_share_one_state(engine, ckpts, monkeypatch):
    paths = []
    real = ModelRunner._greedy_tail
    monkeypatch.setattr(ModelRunner, "_greedy_tail", lambda self, inp: paths.append(r := real(self, inp)) or r)
    for i in range(2):
        engine.submit(f"g{i}", PROMPTS[i], max_new_tokens=20, ignore_eos=True)
    engine.run(until=lambda: True in paths)  # the compiled tail has written slot state
    before = len(paths)
    engine.submit("lp", PROMPTS[2], max_new_tokens=3, ignore_eos=True, logprobs=2)  # eager selection meanwhile
    engine.run()
    later = paths[before:]
    assert False in later and later[-1] is True
    for rid, p, n in (("g0", PROMPTS[0], 20), ("g1", PROMPTS[1], 20), ("lp", PROMPTS[2], 3)):
        assert engine.tokens[rid] == hf_greedy(ckpts["gemma4"], p, n, ignore_eos=True), rid


def test_a_failed_build_is_recorded_and_skipped(ckpts, tmp_path, monkeypatch, caplog):
    """A build that raises writes its reason into the key's directory: the next start runs eagerly
    at once, with the reason in one warning line (no second attempt)."""
    from gpu_worker.graphs import cpu_build

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    spec = cpu_build.BuildSpec(ckpts["gemma4"], None, "float32", 1, 4)
    key_dir = tmp_path / "tandem-cpu-steps" / cpu_build.cache_key(spec)
    monkeypatch.setattr(cpu_build, "build", lambda *a: (_ for _ in ()).throw(NotImplementedError("softcap")))
    key_dir.mkdir(parents=True)
    with pytest.raises(SystemExit):
        cpu_build.build_or_record(spec, str(key_dir))
    assert (key_dir / cpu_build.FAILED).read_text() == "NotImplementedError: softcap"
    monkeypatch.setattr(cpu_build, "_run_build", lambda *a: pytest.fail("built again"))
    assert cpu_build.ensure_built(spec) is None
    assert "their build failed: NotImplementedError: softcap" in caplog.text


def test_the_draft_runs_in_bfloat16_under_the_float32_target_both_column_major(engine):
    target, draft = engine.runner.target, engine.runner.assistant
    assert {p.dtype for p in target.parameters()} == {torch.float32}
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    assert engine.runner.state.hidden.dtype == torch.float32  # the slot state is the target's
    for model in (draft, target):  # the layout the programs' GEMM streams (models/cpu_layout.py)
        w = model.model.layers[0].mlp.gate_up_proj.weight
        assert w.stride() == (1, w.shape[0])


def test_the_programs_link_their_gemm_library(engine):
    """The GEMM library (graphs/cpu_ops.py) is loaded before the packages that link it; it lives
    beside the key directories, shared by every build of the same source (compiled once)."""
    from gpu_worker.graphs.cpu_build import cache_root
    from gpu_worker.graphs.cpu_ops import library_path

    assert isinstance(engine.runner.graphs, CpuDecodeSteps)
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "/libtandem_cpu_" in line}
    assert len(paths) == 1
    path = paths.pop()
    name = os.path.basename(os.path.dirname(path))
    assert path == library_path(cache_root(), name) and name.startswith("tandem_cpu_")


def test_padded_draft_rows_are_lossless(engine, ckpts):
    """Five rows (prompts short enough to prefill in one step) finishing one by one: the draft
    runs 8, 4, 4, 2 and 1 rows (slot 0 past the batch), the target the exact batch; every token
    is the target's greedy one."""
    prompts = [[(5 * j + 11 * i) % 370 + 6 for j in range(4)] for i in range(5)]
    lens = [9, 11, 13, 15, 17]
    for i, n in enumerate(lens):
        engine.submit(f"p{i}", prompts[i], max_new_tokens=n, ignore_eos=True)
    engine.run()
    for i, n in enumerate(lens):
        assert engine.tokens[f"p{i}"] == hf_greedy(ckpts["gemma4"], prompts[i], n, ignore_eos=True), i
    assert {4, 8} <= set(engine.runner.graphs._draft_pad)
    assert torch._C._get_mkldnn_enabled()  # the one-row draft turns oneDNN back on
    engine.core.alloc.check_all_free()


def test_a_build_spreads_its_programs_over_the_cores_for_small_models_only():
    from gpu_worker.graphs.cpu_build import build_groups

    mtp, plain = ("draft", "target", "tail"), ("target", "tail")
    assert build_groups(mtp, 1, small=True) == [mtp]
    assert build_groups(mtp, 2, small=True) == [("target",), ("draft", "tail")]
    assert build_groups(mtp, 4, small=True) == [("draft",), ("target",), ("tail",)]
    assert build_groups(plain, 2, small=True) == [("target",), ("tail",)]
    assert build_groups(mtp, 8, small=False) == [mtp]  # each process would load the models


def test_draft_rows_are_one_or_a_power_of_two():
    assert [draft_rows(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]


def test_draft_dtype_is_bfloat16_only_under_a_float32_target_on_the_compiled_path(monkeypatch):
    from gpu_worker import main

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(main, "native_bf16", lambda: True)
    assert draft_dtype(torch.float32, cpu, "torch") == torch.bfloat16
    assert draft_dtype(torch.float32, cpu, "triton") == torch.float32  # the interpreter's bf16 dots are inexact
    assert draft_dtype(torch.bfloat16, cpu, "torch") == torch.bfloat16
    assert draft_dtype(torch.float32, cuda, "triton") == torch.float32
    assert draft_dtype(torch.bfloat16, cuda, "triton") == torch.bfloat16
    monkeypatch.setattr(main, "native_bf16", lambda: False)  # oneDNN would widen bf16 in software
    assert draft_dtype(torch.float32, cpu, "torch") == torch.float32
    assert draft_dtype(torch.bfloat16, cpu, "torch") == torch.bfloat16


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    from gpu_worker.models import cpu_layout

    monkeypatch.setattr(cpu_layout, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert cpu_layout.native_bf16()
    monkeypatch.setattr(cpu_layout, "cpu_flags", lambda: {"avx512f", "avx2"})
    assert not cpu_layout.native_bf16() and not cpu_layout.amx_usable()


def test_a_bfloat16_query_attends_in_the_float32_pool_dtype():
    assert _work_dtype(torch.bfloat16, torch.float32) == torch.float32
    assert _work_dtype(torch.float32, torch.float32) == torch.float32
    assert _work_dtype(torch.bfloat16, torch.bfloat16) == torch.bfloat16
    assert _work_dtype(torch.bfloat16, torch.float8_e4m3fn) == torch.bfloat16


def test_the_draft_dtype_is_part_of_the_build_key(ckpts):
    from gpu_worker.graphs.cpu_build import BuildSpec, cache_key

    f32 = BuildSpec(ckpts["gemma4"], ckpts["assistant"], "float32", 4, 4, draft_dtype="float32")
    assert cache_key(f32) != cache_key(BuildSpec(ckpts["gemma4"], ckpts["assistant"], "float32", 4, 4,
                                                 draft_dtype="bfloat16"))
