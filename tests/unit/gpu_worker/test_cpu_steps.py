"""The compiled CPU decode steps (``graphs/cpu_steps.py``, built by ``graphs/cpu_build.py``) in the
in-process engine, MTP on: greedy tokens equal HF transformers' for batches of every size up to
the slot count, a batch goes from the greedy tail to the eager token selection and back (a
logprobs request joins and leaves) on one slot state, and ``--disable-cuda-graph`` turns the
path off. The first run on a machine builds the tiny pair's programs (a minute or two)."""

from __future__ import annotations

import pytest

from gpu_worker.graphs.cpu_steps import CpuDecodeSteps
from gpu_worker.step.runner import ModelRunner
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.inproc import InProcEngine

pytestmark = pytest.mark.heavy  # minutes of work: started first (tests/conftest.py)

PROMPTS = [[(7 * j + 3 * i) % 370 + 6 for j in range(5 + 9 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def engine(ckpts):
    return InProcEngine(ckpts["gemma4"], draft=ckpts["assistant"], compiled=True, page_size=4,
                        chunked_prefill_size=24, max_running_requests=6)


def test_steps_are_compiled_and_the_flag_turns_them_off(engine, ckpts):
    assert isinstance(engine.runner.graphs, CpuDecodeSteps)
    off = InProcEngine(ckpts["gemma4"], draft=ckpts["assistant"], compiled=True, page_size=4, disable_cuda_graph=True)
    assert off.runner.graphs is None


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
    monkeypatch.setattr(cpu_build, "build", lambda spec, key_dir: (_ for _ in ()).throw(NotImplementedError("softcap")))
    key_dir.mkdir(parents=True)
    with pytest.raises(SystemExit):
        cpu_build.build_or_record(spec, str(key_dir))
    assert (key_dir / cpu_build.FAILED).read_text() == "NotImplementedError: softcap"
    monkeypatch.setattr(cpu_build, "_run_build", lambda *a: pytest.fail("built again"))
    assert cpu_build.ensure_built(spec) is None
    assert "their build failed: NotImplementedError: softcap" in caplog.text
