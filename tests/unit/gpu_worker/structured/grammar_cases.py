"""The structured-output cases shared by the engine's grammar tests: grammar specs and prompts,
the tiny checkpoints, and the reference (HF logits masked by xgrammar's own matcher)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import xgrammar as xgr  # a core dependency: if it is missing the grammar tests fail loudly

from proto.messages import GrammarSpec
from tests.helpers.checkpoints import EOS, VOCAB, build_assistant, build_gemma4, build_llama

ENDS = (EOS, 5)  # the test checkpoints' generation_config end ids

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "c": {"enum": ["red", "green"]}},
          "required": ["n", "c"]}
SPECS = {
    "json": GrammarSpec("json", json.dumps(SCHEMA)),
    "regex": GrammarSpec("regex", r"[0-9]{2,4}-(ab|cd)+\."),
    "choice": GrammarSpec("choice", json.dumps(["yes", "no", "maybe so", "l'été \"x\""])),
    "ebnf": GrammarSpec("ebnf", 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+'),
}
PROMPTS = [[(7 * i + 3 * j) % 300 + 6 for j in range(3 + 5 * i)] for i in range(3)]


def grammar_compiler(model_dir):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=list(ENDS))
    return xgr.GrammarCompiler(info)


def _compiled(compiler, spec: GrammarSpec):
    if spec.kind == "json":
        return compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "choice":  # written independently of the worker's EBNF: a regex alternation
        return compiler.compile_regex("|".join(re.escape(c) for c in json.loads(spec.text)))
    if spec.kind == "structural_tag":  # (the format form)
        return compiler.compile_structural_tag(spec.text)
    return compiler.compile_grammar(spec.text)


def reference(model, compiler, spec, prompt, n) -> list[int]:
    """Greedy decoding of HF logits masked by xgrammar (its CPU mask kernel) from the first token,
    or from the token after ``spec.after``; ends on an end id."""
    matcher = xgr.GrammarMatcher(_compiled(compiler, spec))
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    seq, out, bound = list(prompt), [], spec.after < 0
    while len(out) < n:
        with torch.no_grad():
            logits = model(torch.tensor([seq], device=model.device)).logits[0, -1:].float().cpu()
        if bound:
            matcher.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
        tok = int(logits.argmax())
        out.append(tok)
        seq.append(tok)
        if bound:
            assert matcher.accept_token(tok)
        bound = bound or tok == spec.after
        if tok in ENDS:
            break
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar")
    llama = build_llama(os.path.join(root, "l"))
    g = build_gemma4(os.path.join(root, "g"))
    return llama, g, build_assistant(os.path.join(root, "a"), g)
