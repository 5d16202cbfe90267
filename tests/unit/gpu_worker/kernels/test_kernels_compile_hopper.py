"""Every Triton kernel variant the engine launches builds for the H200 (sm_90) -- checked in CI,
which has no GPU (``tests/helpers/hopper_compile.py``): the engine runs its triton-backend paths
under the interpreter while each launch is recorded, then a process without the interpreter
compiles each recorded variant, with the constexprs the host sets by device at their CUDA values,
down to a cubin (each kernel with PDL both off and on). ``make hopper-check`` repeats the compile with the
GPU machine's Triton (3.6) as well."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers.hopper_compile import SMEM_LIMIT, launchable_kernels

pytest.importorskip("triton")
pytestmark = pytest.mark.heavy  # minutes of work: started first (tests/conftest.py)
ROOT = pathlib.Path(__file__).resolve().parents[4]


def _run(mode: str, *paths, cache: pathlib.Path, interpret: bool, ok: bool = True) -> None:
    # No TANDEM_* switch of the pytest process may narrow what is recorded: only the run's own.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("TANDEM_")}
    env.update(TRITON_CACHE_DIR=str(cache), TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(ROOT))
    if interpret:
        env.update(TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-m", "tests.helpers.hopper_compile", mode, *map(str, paths)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == (0 if ok else 1), p.stderr[-4000:]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("hopper")
    _run("record", d / "launches.json", d / "ckpts", cache=d / "cache", interpret=True)
    return d


@pytest.fixture(scope="module")
def compiled(recorded) -> list[dict]:
    d = recorded
    _run("compile", d / "launches.json", d / "rows.json", cache=d / "cache", interpret=False)
    return json.loads((d / "rows.json").read_text())


def test_launches_are_recorded_as_the_h200_would_make_them(recorded):
    """PDL levels and prefetch depths by the CUDA rule (not the CPU's "off"), RoPE one head a
    program (the CPU groups them), and the decode kernel both split (small batches on 132 SMs)
    and unsplit with its rows longest first."""
    records = [json.loads(r) for r in json.loads((recorded / "launches.json").read_text())]
    assert len(records) > 50
    with_pdl = {r["name"] for r in records if "PDL" in r["kwargs"]}
    assert with_pdl == {r["name"] for r in records if r["kwargs"].get("PDL") == 2}  # on at <= 4 tokens
    assert any(r["kwargs"].get("PDL") == 0 for r in records)  # off above
    for name in ("_gemv_kernel", "_gemv_dot_kernel", "_qkv_rope_kernel"):
        assert any(r["kwargs"].get("PREFETCH_K", 0) > 0 for r in records if r["name"] == name), name
    assert {r["kwargs"]["HB"] for r in records if r["name"] == "_rope_store_kernel"} == {1}  # decode sizes, GPU rule
    decode = [r["kwargs"] for r in records if r["name"] == "_decode_kernel"]
    assert {kw["SPLITS"] > 1 for kw in decode} == {True, False} and any(kw["ORDERED"] for kw in decode)


def test_every_recorded_variant_builds_within_sm90_shared_memory(compiled):
    rows, version = compiled[:-1], compiled[-1]["triton"]
    failed = [f"{r['kernel']} (PDL {r['pdl']}): {r['error'][:800]}" for r in rows if r["error"]]
    assert not failed, f"Triton {version}, sm_90:\n" + "\n".join(failed)
    assert len(rows) > 100 and all(0 <= r["shared"] <= SMEM_LIMIT for r in rows)


def test_every_launched_kernel_is_covered(compiled):
    rows = compiled[:-1]
    kernels = {r["kernel"] for r in rows}
    assert launchable_kernels() <= kernels, sorted(launchable_kernels() - kernels)
    assert "gpu_worker.kernels.gemv_kernels._gemv_kernel" in {r["kernel"] for r in rows if r["pdl"] == 2}
    with_pdl = {r["kernel"] for r in rows if r["pdl"] is not None}
    for level in (0, 2):  # each kernel's PDL-off and PDL-on code is built
        assert with_pdl <= {r["kernel"] for r in rows if r["pdl"] == level}, level


def test_the_check_fails_on_what_an_h200_rejects(tmp_path):
    """The interpreter would run all three; the compile check must not pass them, including the
    one broken only in the PDL-on build a CPU launch never makes."""
    t = {"tensor": "bfloat16", "aligned16": True}
    mod = "tests.helpers.hopper_bad_kernels"
    records = [json.dumps({"module": mod, "name": "_smem_hog_kernel", "args": [t, t, {**t, "tensor": "float32"}],
                           "kwargs": {"N": 256, "num_warps": 4}}),
               json.dumps({"module": mod, "name": "_bad_ptx_kernel", "args": [{**t, "tensor": "int32"}],
                           "kwargs": {"BLOCK": 128}}),
               json.dumps({"module": mod, "name": "_bad_when_pdl_kernel", "args": [{**t, "tensor": "int32"}],
                           "kwargs": {"BLOCK": 128, "PDL": 0}})]  # as the CPU records it
    (tmp_path / "bad.json").write_text(json.dumps(records))
    _run("compile", tmp_path / "bad.json", tmp_path / "rows.json", cache=tmp_path / "cache", interpret=False, ok=False)
    rows = json.loads((tmp_path / "rows.json").read_text())[:-1]
    errors = {(r["kernel"].rsplit(".", 1)[1], r["pdl"]): r["error"] for r in rows}
    assert "shared memory" in errors["_smem_hog_kernel", None]
    assert "PTXAS" in errors["_bad_ptx_kernel", None].upper()
    assert errors["_bad_when_pdl_kernel", 0] is None
    assert "PTXAS" in errors["_bad_when_pdl_kernel", 2].upper()
