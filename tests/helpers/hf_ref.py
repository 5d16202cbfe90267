"""HF transformers references for the API end-to-end and engine tests (float32, CPU, one thread).

- ``logprob_rows``: log_softmax of the model's logits at every position of a token sequence
  (row i is the distribution of token i+1), the oracle for completion and prompt logprobs.
- ``greedy``: a plain greedy loop with vLLM's logits processing, the oracle for penalties and
  ``min_tokens``: logit bias first, then repetition penalty over prompt + output tokens (logit > 0 -> logit / p, else
  logit * p), then frequency (x count among output tokens) and presence (x seen among output
  tokens) penalties, and stop tokens masked to -inf while fewer than ``min_tokens`` tokens exist.
- ``stop_case``: picks a stop string out of a reference text that straddles token boundaries.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from tests.helpers.checkpoints import hf_model


@functools.lru_cache(maxsize=8)
def tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(path, "tokenizer.json"))


def eos_ids(path: str) -> tuple[int, ...]:
    with open(os.path.join(path, "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    return tuple(eos) if isinstance(eos, list) else (eos,)


def encode(path: str, text: str) -> list[int]:
    return tokenizer(path).encode(text).ids


def decode(path: str, ids, skip_special_tokens: bool = True) -> str:
    return tokenizer(path).decode(list(ids), skip_special_tokens=skip_special_tokens)


@functools.lru_cache(maxsize=64)
def _logits(path: str, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([list(ids)]), use_cache=False).logits[0].float()


def logprob_rows(path: str, ids) -> torch.Tensor:
    """[len(ids), vocab] float32 log-probabilities; row i predicts token i + 1."""
    return torch.log_softmax(_logits(path, tuple(ids)), dim=-1)


def greedy(path: str, prompt: list[int], max_new: int, *, presence: float = 0.0, frequency: float = 0.0,
           repetition: float = 1.0, min_tokens: int = 0, stop_ids=(), ignore_eos: bool = False,
           logit_bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decoding with vLLM's logit bias / penalty / min_tokens semantics (the bias first,
    then the penalties, as vLLM orders them); stops after a stop token."""
    stops = set(stop_ids) | (set() if ignore_eos else set(eos_ids(path)))
    out: list[int] = []
    for _ in range(max_new):
        logits = _logits(path, tuple(prompt + out))[-1].clone()
        for tok, b in (logit_bias or {}).items():
            logits[tok] += b
        if repetition != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(out)))
            sel = logits[seen]
            logits[seen] = torch.where(sel > 0, sel / repetition, sel * repetition)
        if out:
            counts = torch.bincount(torch.tensor(out), minlength=logits.shape[0]).float()
            logits -= frequency * counts + presence * (counts > 0).float()
        if len(out) < min_tokens and stops:
            logits[sorted(stops)] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if token in stops:
            break
    return out


@dataclass
class StopCase:
    stop: str
    start: int  # where the stop starts in the full text
    n_tokens: int  # completion tokens up to and including the one that completes the stop


def prefix_texts(path: str, ref: list[int]) -> list[str]:
    return [decode(path, ref[:k]) for k in range(len(ref) + 1)]


def stop_case(path: str, ref: list[int], length: int = 3) -> StopCase:
    """A stop string of ``length`` printable ASCII characters whose first occurrence in the
    decoded reference starts inside one token and ends inside a later one."""
    texts = prefix_texts(path, ref)
    full = texts[-1]
    bounds = [len(t) for t in texts]
    for k in range(1, len(ref)):
        # the stop ends 1 character into token k (which must go on after it)
        end = bounds[k] + 1
        start = end - length
        if start < 0 or bounds[k + 1] <= end:
            continue
        stop = full[start:end]
        if not (stop.isascii() and stop.isprintable()) or full.find(stop) != start:
            continue
        # decoding must be stable up to here (no pending multi-byte characters)
        if any(not full.startswith(texts[j]) for j in range(k + 2)):
            continue
        return StopCase(stop, start, k + 1)
    raise AssertionError(f"no stop string candidate in {full!r}")


def expected_stop(texts: list[str], stops: list[str], include: bool = False) -> tuple[str, int, str]:
    """(visible text, completion tokens, matched stop) under the earliest-end rule."""
    full = texts[-1]
    best = None
    for s in stops:
        pos = full.find(s)
        if pos >= 0 and (best is None or (pos + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))):
            best = (pos, s)
    assert best is not None
    pos, s = best
    end = pos + len(s)
    n = next(k for k, t in enumerate(texts) if len(t) >= end and full.startswith(t))
    return full[: end if include else pos], n, s
