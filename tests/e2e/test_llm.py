"""``tandem.LLM`` on the bundled pair (MTP on, by Hub ids) and on a tiny random Llama: one batch of mixed
prompts (text, token ids, prompt dicts) and sampling params answers exactly as a real
``tandem serve`` answers the same requests (greedy and seeded sampling: equal tokens), greedy
matches HF transformers, ``chat`` renders the model's template, bad input is a ValueError, and
no engine process outlives ``shutdown()``, a ``with`` block or a plain script's exit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import huggingface_hub.constants
import pytest

from benchmarks.stream_ends import engine_children
from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.llm import engine_args
from tandem.llm_engine import EngineError
from tests.e2e.ops_util import pid_alive, wait_until
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.hub_cache import add_to_cache
from tests.helpers.server import ROOT, Server

PAIR = os.path.join(ROOT, "models", "tiny-shakespeare")
TARGET = os.path.join(PAIR, "target")
MTP = dict(speculative_algorithm="FROZEN-KV-MTP", speculative_draft_model_path=os.path.join(PAIR, "assistant"),
           speculative_num_steps=3)
QUIET = dict(device="cpu", num_threads=1, log_level="warning")

# (prompt for LLM.generate, SamplingParams, the same request's /v1/completions body)
CASES = [
    ("To be, or not", SamplingParams(temperature=0, max_tokens=24),
     {"prompt": "To be, or not", "temperature": 0, "max_tokens": 24}),
    ({"prompt": "ROMEO:"}, SamplingParams(temperature=0, max_tokens=32, stop=["\n\n"]),
     {"prompt": "ROMEO:", "temperature": 0, "max_tokens": 32, "stop": ["\n\n"]}),
    ([5, 9, 13, 17, 21], SamplingParams(temperature=0, max_tokens=12, logprobs=2),
     {"prompt": [5, 9, 13, 17, 21], "temperature": 0, "max_tokens": 12, "logprobs": 2}),
    ({"prompt_token_ids": [7, 8, 9, 10]}, SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=16),
     {"prompt": [7, 8, 9, 10], "temperature": 0.8, "seed": 11, "n": 2, "max_tokens": 16}),
    ("The king", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
     {"prompt": "The king", "temperature": 0, "max_tokens": 20, "ignore_eos": True, "repetition_penalty": 1.3}),
]


@pytest.fixture(scope="module", params=["pair", "llama"])
def engines(request, ckpts, tmp_path_factory):
    """An LLM and a server on one model, started together; the LLM's children are checked gone
    after its ``shutdown``. The LLM names the bundled pair by Hub ids, served from an offline
    cache as ``tandem serve`` resolves them; the server gets the directories."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "pair":
            mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
            home = str(tmp_path_factory.mktemp("hf"))
            add_to_cache(home, "org/tiny", TARGET)
            add_to_cache(home, "org/tiny-draft", MTP["speculative_draft_model_path"])
            model, llm_kw, server_argv = "org/tiny", {**MTP, "speculative_draft_model_path": "org/tiny-draft",
                                                      "download_dir": os.path.join(home, "hub")}, (None,)
        else:
            model, llm_kw, server_argv = ckpts["llama"], {}, (ckpts["llama"],)
        srv = Server(*server_argv, wait=False)
        llm = LLM(model, **llm_kw, **QUIET)
    pids = [p.pid for p in llm._engine.sup.procs.values()]
    try:
        yield request.param, llm.args.model_path, llm, srv.wait_ready()
    finally:
        srv.stop()
        llm.shutdown()
    assert not any(pid_alive(p) for p in pids)


@pytest.fixture(scope="module")
def batch(engines):
    _, _, llm, srv = engines
    outs = llm.generate([c[0] for c in CASES], [c[1] for c in CASES], use_tqdm=False)
    served = [httpx.post(srv.url + "/v1/completions", json=c[2], timeout=60).json() for c in CASES]
    return outs, served


def test_batch_equals_the_server_token_for_token(batch):
    outs, served = batch
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)  # input order
    for out, body in zip(outs, served):
        assert len(out.outputs) == len(body["choices"])
        for mine, theirs in zip(out.outputs, body["choices"]):
            assert mine.text == theirs["text"]
            assert mine.finish_reason == theirs["finish_reason"]
            assert mine.stop_reason == theirs["stop_reason"]
        assert sum(len(c.token_ids) for c in out.outputs) == body["usage"]["completion_tokens"]
        assert len(out.prompt_token_ids) == body["usage"]["prompt_tokens"]


def test_logprobs_as_the_server_reports_them(batch):
    outs, served = batch
    mine, theirs = outs[2].outputs[0], served[2]["choices"][0]["logprobs"]
    assert len(mine.logprobs) == len(mine.token_ids) == len(theirs["token_logprobs"])
    for token, row, lp in zip(mine.token_ids, mine.logprobs, theirs["token_logprobs"]):
        assert row[token].logprob == pytest.approx(lp, abs=1e-4)
        assert row[token].rank == 1  # greedy: the chosen token is the most likely
        assert len(row) == 2  # the chosen token is one of the top 2
    assert mine.cumulative_logprob == pytest.approx(sum(theirs["token_logprobs"]), abs=1e-3)
    assert outs[0].outputs[0].logprobs is None and outs[0].outputs[0].cumulative_logprob is None


def test_greedy_equals_hf_transformers(engines, batch):
    _, path, llm, _ = engines
    outs, _ = batch
    for out, (_, sp, _) in zip(outs, CASES):
        if sp.temperature == 0 and not sp.stop and sp.repetition_penalty is None:
            ref = hf_greedy(path, out.prompt_token_ids, sp.max_tokens)
            assert out.outputs[0].token_ids == ref
            assert out.outputs[0].text == llm.get_tokenizer().decode(ref)


def test_outputs_carry_prompt_and_metrics(batch):
    outs, _ = batch
    assert outs[0].prompt == "To be, or not" and outs[2].prompt is None
    assert outs[2].prompt_token_ids == [5, 9, 13, 17, 21]
    assert [c.index for c in outs[3].outputs] == [0, 1]
    m = outs[0].metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.num_generation_tokens == len(outs[0].outputs[0].token_ids) and m.first_token_latency > 0


def test_chat_renders_the_template(engines):
    from transformers import AutoTokenizer

    _, path, llm, srv = engines
    messages = [{"role": "user", "content": "Who goes there?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    want = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=False)
    assert out.prompt == want
    served = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                        json={"messages": messages, "temperature": 0, "max_tokens": 12}).json()
    assert out.outputs[0].text == served["choices"][0]["message"]["content"]
    two = llm.chat([messages, messages], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [out.outputs[0].token_ids[:4]] * 2
    cont = llm.chat(messages + [{"role": "assistant", "content": "Nay, answer"}], SamplingParams(max_tokens=2),
                    use_tqdm=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("Nay, answer")


def test_structured_output_without_whitespace(engines):
    """``disable_any_whitespace``: the model's JSON has fixed separators (xgrammar's, as in vLLM:
    one space after ',' and ':'), where it ran on in newlines and spaces without the option."""
    _, _, llm, _ = engines
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["yes", "no"]}},
              "required": ["a", "b"]}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    text = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=40, structured_outputs=so),
                        use_tqdm=False)[0].outputs[0].text
    assert text == json.dumps(json.loads(text)) and set(json.loads(text)) == {"a", "b"}


def test_bad_requests_are_value_errors(engines):
    _, _, llm, _ = engines
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate("To be", SamplingParams(max_tokens=10**6), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("To be", SamplingParams(temperature=-1.0), use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["To be"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="detokenize=False"):
        llm.generate("To be", SamplingParams(stop=["x"], detokenize=False), use_tqdm=False)
    with pytest.raises(ValueError, match="regex"):  # the worker's compile error, the batch aborted
        llm.generate(["To be", "ROMEO:"], [SamplingParams(max_tokens=64),
                     SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))], use_tqdm=False)
    ok = llm.generate("To be", SamplingParams(temperature=0, max_tokens=4, detokenize=False), use_tqdm=False)[0]
    assert ok.outputs[0].text == "" and len(ok.outputs[0].token_ids) == 4


def test_engine_arguments_are_checked_before_any_process(tmp_path):
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(TARGET, no_such_flag=1)
    with pytest.raises(TypeError, match="'seed' sets 'random_seed', which another argument already set"):
        LLM(TARGET, random_seed=1, seed=2)
    with pytest.raises(ValueError, match="--model-path"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="--overlap-depth"):
        LLM(TARGET, overlap_depth=7)
    with pytest.raises(ValueError, match="^--model-path: 'org/nope' is not a local directory"):
        LLM("org/nope", download_dir=str(tmp_path))
    # vLLM's keyword names are the flags' vLLM spellings; strings are read as the flag reads them
    args = engine_args(TARGET, tensor_parallel_size=1, max_model_len="2k", seed=3, max_num_seqs=4, dtype="float")
    assert (args.tp_size, args.context_length, args.random_seed, args.max_running_requests, args.dtype) == \
        (1, 2000, 3, 4, "float32")


def test_an_engine_that_cannot_start_is_one_line_and_no_process(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TARGET, name), tmp_path / name)
    with open(os.path.join(TARGET, "config.json")) as f:
        config = {**json.load(f), "architectures": ["NoSuchModelForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    before = set(engine_children(os.getpid()).values())
    with pytest.raises(EngineError, match="^worker: .*NoSuchModelForCausalLM"):
        LLM(str(tmp_path), **QUIET)
    assert set(engine_children(os.getpid()).values()) == before


def test_with_block_and_script_exit_leave_no_process(ckpts, tmp_path):
    with LLM(ckpts["llama"], **QUIET) as llm:
        pids = [p.pid for p in llm._engine.sup.procs.values()]
        assert len(llm.generate("To be", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    assert not any(pid_alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("To be", use_tqdm=False)
    # A plain script, no __main__ guard, no shutdown(): the interpreter's exit stops the engine.
    script = tmp_path / "script.py"
    script.write_text("from tandem import LLM\n"
                      f"llm = LLM({ckpts['llama']!r}, device='cpu', num_threads=1, log_level='warning')\n"
                      "print([p.pid for p in llm._engine.sup.procs.values()])\n"
                      "print(repr(llm.generate(['To be'], use_tqdm=False)[0].outputs[0].text))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    pids = json.loads(run.stdout.splitlines()[0])
    assert len(pids) == 2 and wait_until(lambda: not any(pid_alive(p) for p in pids), 5)
