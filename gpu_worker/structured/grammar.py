"""Structured output on the worker: an xgrammar matcher per slot, a token mask per sampled position.

Why the worker: it holds the tokens first (on the device), MTP's drafts exist only here, and the
masks apply in the eager selection path beside logit_bias and penalties (never inside a graph).

Life of a constrained request (``SamplingParams.grammar``):
- before admission: the scheduler holds the request and sends its spec (``StepPlan.compile``);
  it compiles on a side thread into ``ready`` (``precompile``), and a later result says so
  (``StepResult.compiled``, ``take_compiled``): the scheduler then queues the request, or ends
  it with HTTP 400 (a spec that does not compile) before it takes a slot. No step waits on a
  compile (scheduler_proc/grammar_gate.py).
- admission: the slot gets a fresh matcher from ``ready``. A re-admission whose spec has left
  ``ready`` compiles again on the side thread while it prefills, its first sample waits if
  needed, and a failure there is a slot error in that step's result (``StepResult.errors``):
  the scheduler ends the request, the slot samples unconstrained until freed (tokens dropped).
- a re-prefill after preemption feeds the outputs it re-reads (positions >= prompt_len) to the
  new matcher (``observe_extend``), so the grammar resumes where it was; the scheduler keeps its
  prefix-cache hit inside the prompt (``planner._usable_pages``), so it re-reads every output.
- a step that samples for a constrained row queues its forward (draft chain, target forward),
  then has every step in flight return (``needs_sync`` → the caller's ``retire``, from
  ``ModelRunner.launch``), then builds its masks: the host must know a row's last token to mask
  its next one, and the device runs this step's forward meanwhile. Steps without one keep the
  full overlap.
- masks: position 0 from the matcher's state; with MTP, verify position i from the state after
  the row's drafts d1..di (the drafts are read back first), rolled back afterwards. A draft the
  grammar refuses ends the row's masks there: verify rejects it, since position i-1 masks it out.
- the step's result: the accepted tokens advance the matcher (``observe``, from
  ``Pending.result``, in step order). Once the grammar is complete only end ids stay allowed.
- a grammar with ``after`` (the reasoning end token) waits in ``self.after`` until the row emits
  that token: until then its positions are unconstrained (no mask), the tokens after it are the
  grammar's first. Verify positions follow the drafts: a draft equal to the token makes the next
  position the grammar's first. The row still counts as constrained (``needs_sync``): whether the
  steps in flight emitted the token is known only once they return.
- free: the matcher goes with the slot.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from proto.messages import GrammarCompile, GrammarDone, GrammarSpec, SlotError, StepPlan

log = logging.getLogger("tandem.worker")
READY_MAX = 256  # compiled grammars kept for admission (least recently used dropped)
# xgrammar's "[10:33:22] /path/file.cc:94: " and its internal "Check failed: (cond) is false: "
_LOG_PREFIX = re.compile(r"^(\[[\d:]+\] \S+:\d+: )?(Check failed: \(.*?\) is false: )?")


def tokenizer_info(tokenizer_dir: str, vocab_size: int, eos_ids: tuple[int, ...]):
    """xgrammar's view of the vocabulary, from ``tokenizer.json`` (the model's vocab size: rows
    past the tokenizer's are never allowed)."""
    import xgrammar as xgr  # noqa: PLC0415 - heavy (torch, tvm-ffi): only once a request asks
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    encoded = [""] * vocab_size
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = text
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())  # what from_huggingface reads
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(eos_ids) or None, add_prefix_space=meta["add_prefix_space"])


def choice_grammar(text: str) -> str:
    """A ``choice`` spec (a JSON array of strings) as EBNF: root ::= "a" | "b" | ..."""
    choices = json.loads(text)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("choice must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_structural_tag(compiler, text: str):
    """The front's canonical text: xgrammar's ``{"type": "structural_tag", "format": ...}``, or the
    older ``{"structures": [...], "triggers": [...]}`` (xgrammar's deprecated item list, which vLLM
    and SGLang still take)."""
    import xgrammar as xgr  # noqa: PLC0415

    tag = json.loads(text)
    if "structures" not in tag:
        return compiler.compile_structural_tag(text)
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in tag["structures"]]
    return compiler.compile_structural_tag(items, tag["triggers"])


def compile_spec(compiler, spec: GrammarSpec, any_whitespace: bool = True):
    if spec.kind == "json":
        return compiler.compile_json_schema(spec.text, any_whitespace=any_whitespace and spec.any_whitespace)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.text)
    if spec.kind == "choice":
        return compiler.compile_grammar(choice_grammar(spec.text))
    if spec.kind == "structural_tag":
        return compile_structural_tag(compiler, spec.text)
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


class GrammarRows:
    """Per-slot matchers and the masks they give; host state only, plus one small upload a step."""

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, eos_ids: tuple[int, ...], device,
                 any_whitespace: bool = True):
        self.tokenizer_dir, self.vocab, self.eos, self.device = tokenizer_dir, vocab_size, tuple(eos_ids), device
        self.any_whitespace = any_whitespace  # False: --constrained-json-disable-any-whitespace
        self.words = (vocab_size + 31) // 32
        self.matchers: dict[int, object] = {}  # slot -> xgrammar GrammarMatcher
        self.compiling: dict[int, Future] = {}  # slot -> its grammar's compile (-> a matcher)
        self.prompt_len: dict[int, int] = {}
        self.after: dict[int, int] = {}  # slot -> the token its grammar waits for (reasoning's end)
        self.errors: list[SlotError] = []  # compile errors for the next step's result (``take_errors``)
        # Ahead of admission (``precompile``): spec -> compiled grammar or its error, and the
        # compiles running for the scheduler's keys; ``done`` waits for the next step's result.
        self.ready: OrderedDict[GrammarSpec, object] = OrderedDict()
        self.precompiling: dict[int, tuple[GrammarSpec, Future]] = {}
        self.done: list[GrammarDone] = []
        self._compiler = None
        self._pool: ThreadPoolExecutor | None = None
        self._compiler_lock = threading.Lock()  # the compile threads build the compiler once

    # ------------------------------------------------------------ per-request state
    def stage(self, plan: StepPlan) -> None:
        """Freed slots drop their matchers; admitted constrained requests start compiling."""
        for s in (*plan.free, *(r.slot for r in plan.admit)):  # a reused slot starts clean
            self.matchers.pop(s, None)
            self.after.pop(s, None)
            self.compiling.pop(s, None)  # (a compile still running finishes unread)
        for row in plan.admit:
            if row.params.grammar is not None:
                self.prompt_len[row.slot] = row.prompt_len
                if row.params.grammar.after >= 0:
                    self.after[row.slot] = row.params.grammar.after
                got = self.ready.get(row.params.grammar)
                if got is None:  # not compiled ahead (a re-admission after it left ``ready``)
                    self.compiling[row.slot] = self._executor().submit(self._compile_grammar, row.params.grammar)
                else:
                    self.ready.move_to_end(row.params.grammar)
                    self._install(row.slot, got)

    def precompile(self, items: list[GrammarCompile]) -> None:
        """Waiting requests' grammars (``StepPlan.compile``), compiled on the side thread; the
        scheduler admits a request only once its ``GrammarDone`` came back, so no step waits for
        a compile (a deep schema can take seconds), as vLLM and SGLang hold such requests."""
        for item in items:
            if item.spec in self.ready:
                self.done.append(GrammarDone(item.key, _error(self.ready[item.spec])))
            else:
                self.precompiling[item.key] = (item.spec, self._executor().submit(self._compile_grammar, item.spec))

    def take_compiled(self, wait_s: float = 0.0) -> list[GrammarDone]:
        """The precompiles finished since the last call (waiting up to ``wait_s`` for one: a step
        that carries nothing else, which the scheduler sends to ask)."""
        if not self.precompiling and not self.done:  # every step asks; most have nothing
            return []
        if wait_s and self.precompiling:
            wait([f for _, f in self.precompiling.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        for key, (spec, fut) in list(self.precompiling.items()):
            if fut.done():
                del self.precompiling[key]
                self.ready[spec] = got = fut.result()
                self.ready.move_to_end(spec)
                if len(self.ready) > READY_MAX:
                    self.ready.popitem(last=False)
                self.done.append(GrammarDone(key, _error(got)))
        out, self.done = self.done, []
        return out

    def _executor(self) -> ThreadPoolExecutor:
        """Compile threads: xgrammar releases the GIL while it compiles, so steps go on meanwhile
        (a 40-field schema over a 150k vocabulary: ~0.2 s), and one slow grammar (a deep schema:
        seconds) leaves the others a thread: half the cores, 2 to 4."""
        if self._pool is None:
            n = min(4, max(2, (os.cpu_count() or 2) // 2))
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="tandem-grammar")
        return self._pool

    def _compile_grammar(self, spec: GrammarSpec):
        """-> the compiled grammar, or the error message for the request (on the compile thread)."""
        try:
            compiler = self._get_compiler()  # imports xgrammar: heavy (torch, tvm-ffi), only once asked
        except Exception as exc:  # xgrammar missing, no tokenizer.json: every constrained request
            return f"structured output is unavailable: {_first_line(exc)}"
        try:
            return compile_spec(compiler, spec, self.any_whitespace)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError for a bad spec
            return f"invalid {spec.kind} grammar: {_first_line(exc)}"

    def _resolve(self, slots) -> None:
        """Compiles of these slots finished (waiting for them): matchers in, errors queued."""
        for s in slots:
            fut = self.compiling.pop(int(s), None)
            if fut is None:
                continue
            self._install(int(s), fut.result())

    def _install(self, slot: int, got) -> None:
        """A compiled grammar becomes the slot's fresh matcher; an error, the request's end."""
        if isinstance(got, str):
            self.errors.append(SlotError(slot, got))
        else:
            import xgrammar as xgr  # noqa: PLC0415 - loaded by the compile already

            self.matchers[slot] = xgr.GrammarMatcher(got)

    def _get_compiler(self):
        with self._compiler_lock:  # (xgrammar's compiler itself serves several threads)
            if self._compiler is None:
                import xgrammar as xgr  # noqa: PLC0415

                if self.tokenizer_dir is None:
                    raise ValueError("the model's tokenizer.json is needed")
                self._compiler = xgr.GrammarCompiler(tokenizer_info(self.tokenizer_dir, self.vocab, self.eos))
                log.info("structured output: xgrammar %s ready", getattr(xgr, "__version__", ""))
            return self._compiler

    def take_errors(self) -> list[SlotError]:
        out, self.errors = self.errors, []
        return out

    # ------------------------------------------------------------ which steps
    def active(self, slots: np.ndarray) -> bool:
        """Is any of these slots constrained (its grammar compiled or compiling)?"""
        if not self.matchers and not self.compiling:
            return False
        return any(int(s) in self.matchers or int(s) in self.compiling for s in slots)

    def needs_sync(self, plan: StepPlan) -> bool:
        """Does ``plan`` sample for a constrained slot whose matcher may lag the steps in flight?
        (A slot admitted by this plan starts fresh, and one still compiling has sampled nothing:
        nothing in flight concerns them.)"""
        if not self.matchers:
            return False
        new = {r.slot for r in plan.admit}
        rows = np.frombuffer(plan.decode_slots, dtype=np.int32).tolist() + [e.slot for e in plan.extend if e.sample]
        return any(s in self.matchers and s not in new for s in rows)

    # ------------------------------------------------------------ tokens in
    def observe_extend(self, rows) -> None:
        """A re-prefill's generated tokens (positions >= prompt_len) advance its fresh matcher."""
        if not (self.matchers or self.compiling) or not len(rows.ext_slots):
            return
        offsets = np.cumsum(rows.ext_len) - rows.ext_len
        for i, slot in enumerate(rows.ext_slots.tolist()):
            if slot in self.compiling and rows.ext_start[i] + rows.ext_len[i] > self.prompt_len[slot]:
                self._resolve([slot])  # outputs to replay: the matcher is needed now
            m = self.matchers.get(slot)
            if m is None:
                continue
            start, n = int(rows.ext_start[i]), int(rows.ext_len[i])
            toks = rows.ext_tokens[offsets[i]: offsets[i] + n]
            self._advance(slot, m, toks[max(0, self.prompt_len[slot] - start):])

    def observe(self, slots: np.ndarray, tokens: np.ndarray, accept: np.ndarray) -> None:
        """A returned step's new tokens, rows in result order (tokens [R, T], accept [R]); a
        token the matcher refuses is one the scheduler drops too (``_feed``)."""
        for r, slot in enumerate(slots.tolist()):
            m = self.matchers.get(slot)
            if m is not None:
                self._advance(slot, m, tokens[r, : accept[r]])

    def _advance(self, slot: int, m, tokens: np.ndarray) -> None:
        """``tokens`` emitted by ``slot``: a grammar still waiting for its start token binds
        from the token after it; a bound one consumes them all (``_feed``)."""
        start = self.after.get(slot)
        if start is not None:
            hits = np.flatnonzero(tokens == start)
            if not len(hits):
                return
            del self.after[slot]
            tokens = tokens[hits[0] + 1:]
        _feed(m, tokens)

    # ------------------------------------------------------------ masks out
    def apply(self, logits: torch.Tensor, raw: torch.Tensor, slots: np.ndarray,
              drafts: torch.Tensor | None = None, min_tokens: bool = False) -> torch.Tensor:
        """``logits`` [R*N, V] (the processed copy, or the raw logits) with -inf on the tokens
        the grammar refuses at the constrained rows' positions; N = 1 + the rows' drafts
        [R, N-1]. ``min_tokens``: some row masks its end ids now, so a position may be left
        with no token; it then takes the grammar's mask over ``raw`` (the grammar wins)."""
        self._resolve(slots)  # a row's first sample: its grammar must be compiled by now
        n = 1 if drafts is None else drafts.shape[1] + 1
        d_host = drafts.cpu().numpy() if drafts is not None else None  # the step's one read-back
        mask = torch.full((len(slots) * n, self.words), -1, dtype=torch.int32)  # -1: all allowed
        rows = []
        for r, slot in enumerate(slots.tolist()):
            m, start = self.matchers.get(slot), self.after.get(slot)
            drafts_r = None if d_host is None else d_host[r]
            if m is None or (start is not None and (drafts_r is None or start not in drafts_r)):
                continue  # unconstrained, or reasoning on through every position of this step
            rows.extend(range(r * n, r * n + n))
            self._fill(m, mask, r * n, drafts_r, start)
        if not rows:
            return logits
        every = len(rows) == logits.shape[0]  # (the usual case: no unconstrained row to skip)
        idx = None if every else torch.as_tensor(rows, device=logits.device)
        refused = ~_unpack((mask if every else mask[rows]).to(logits.device), logits.shape[-1])
        masked = (logits if every else logits[idx]).masked_fill(refused, float("-inf"))
        if min_tokens:
            dead = torch.isneginf(masked).all(dim=-1, keepdim=True)
            fallback = (raw if every else raw[idx]).float().masked_fill(refused, float("-inf"))
            masked = torch.where(dead, fallback, masked)
        if every:
            return masked
        out = logits.clone()
        out[idx] = masked
        return out

    def _fill(self, m, mask: torch.Tensor, base: int, drafts: np.ndarray | None, start: int | None = None) -> None:
        """Masks for one row: position 0 from ``m``'s state, later positions after each draft
        while the grammar accepts them (rolled back after). Past the grammar's end only end ids
        stay allowed (``ignore_eos`` / ``min_tokens`` rows go on emitting them). ``start``: the
        grammar still waits for that token; positions up to the draft equal to it stay all-allowed."""
        n = 1 if drafts is None else len(drafts) + 1
        taken = 0
        for i in range(n):
            if i:
                draft = int(drafts[i - 1])
                if start is None:
                    if not m.accept_token(draft):
                        break  # verify rejects this draft: position i - 1 masks it out
                    taken += 1
                elif draft == start:
                    start = None  # (not the grammar's token): position i is the grammar's first
            if start is not None:
                continue  # still reasoning: the mask row stays all-allowed
            if m.is_terminated():
                mask[base + i: base + n] = self._stop_row()
                break
            m.fill_next_token_bitmask(mask, base + i)
        if taken:
            m.rollback(taken)

    def _stop_row(self) -> torch.Tensor:
        row = torch.zeros(self.words, dtype=torch.int32)
        for t in self.eos:
            row[t // 32] |= _bit(t % 32)
        return row


def _feed(m, tokens: np.ndarray) -> None:
    """Advance ``m`` over ``tokens`` up to the first it refuses: past the grammar's end
    (ignore_eos / min_tokens rows go on with end ids), or a row whose request already finished."""
    for tok in tokens.tolist():
        if m.is_terminated() or not m.accept_token(tok):
            break


def _bit(j: int) -> int:
    """Bit j of an int32 word, as a signed value (bit 31 is the sign)."""
    return (1 << j) - (1 << 32 if j == 31 else 0)


def _error(got) -> str:
    return got if isinstance(got, str) else ""


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__


def _unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bit masks [rows, ceil(V/32)] int32 -> allowed [rows, V] bool (bit j of word w: token 32w + j)."""
    bits = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words[:, :, None] >> bits) & 1).bool().reshape(words.shape[0], -1)[:, :vocab]
