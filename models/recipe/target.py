"""Target pre-training on the Shakespeare streams, validation loss, and KV-cached generation."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .arch import TargetLM
from .data import BOS_ID, EOS_IDS


def log(msg: str) -> None:
    print(msg, flush=True)


@dataclass
class TargetTrainCfg:
    seq_len: int = 512
    batch_size: int = 64
    steps: int = 2000
    lr: float = 2e-3
    min_lr_frac: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.1
    dropout: float = 0.2
    chat_frac: float = 0.2
    grad_clip: float = 1.0
    eval_every: int = 100
    log_every: int = 50


class Batcher:
    """Random training rows of seq_len+1 tokens: <bos> + a text window, or chat conversations
    packed from a conversation start (each begins with <bos>)."""

    def __init__(self, text: np.ndarray, chat: np.ndarray, chat_offsets: np.ndarray, seq_len: int,
                 chat_frac: float, seed: int):
        self.text, self.chat, self.seq_len, self.chat_frac = text, chat, seq_len, chat_frac
        n = seq_len + 1
        self.chat_starts = chat_offsets[chat_offsets + n <= len(chat)]
        self.rng = np.random.default_rng(seed)

    def __call__(self, batch: int) -> np.ndarray:
        n = self.seq_len + 1
        rows = np.empty((batch, n), dtype=np.int64)
        is_chat = self.rng.random(batch) < self.chat_frac
        for r in range(batch):
            if is_chat[r] and len(self.chat_starts):
                s = int(self.chat_starts[self.rng.integers(len(self.chat_starts))])
                rows[r] = self.chat[s:s + n]
            else:
                s = int(self.rng.integers(0, len(self.text) - n + 1))
                rows[r, 0] = BOS_ID
                rows[r, 1:] = self.text[s:s + n - 1]
        return rows


def eval_windows(stream: np.ndarray, seq_len: int, offsets: np.ndarray | None = None,
                 max_rows: int | None = None) -> np.ndarray:
    """Non-overlapping validation rows (seq_len+1 tokens): <bos> + text, or from conversation starts."""
    n = seq_len + 1
    rows = []
    if offsets is None:
        for s in range(0, len(stream) - (n - 1) + 1, n - 1):
            rows.append(np.concatenate([[BOS_ID], stream[s:s + n - 1]]))
    else:
        nxt = 0
        for s in offsets:
            if s >= nxt and s + n <= len(stream):
                rows.append(stream[s:s + n])
                nxt = s + n
    rows = np.stack(rows).astype(np.int64)
    return rows[:max_rows] if max_rows else rows


@torch.no_grad()
def eval_loss(model: TargetLM, rows: np.ndarray, batch: int, device, amp: bool) -> float:
    model.eval()
    tot, cnt = 0.0, 0
    for i in range(0, len(rows), batch):
        x = torch.from_numpy(rows[i:i + batch]).to(device)
        with torch.autocast("cuda", torch.bfloat16, enabled=amp):
            logits, _, _ = model(x[:, :-1])
        tot += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        cnt += x[:, 1:].numel()
    return tot / cnt


def lr_at(progress: float, step: int, warmup: int, lr: float, min_frac: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(1.0, progress)
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(model, lr: float, wd: float, device):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, **kw)


def train_target(model: TargetLM, data: dict, cfg: TargetTrainCfg, device, time_cap_s: float,
                 seed: int, compile_model: bool = False) -> dict:
    """Cosine schedule over `steps`; the schedule's progress is max(step/steps, elapsed/time_cap),
    so a slow machine anneals early and stops at the cap instead of overrunning. Keeps the
    weights with the best validation loss (the corpus is small: ~1.4M training tokens)."""
    amp = device.type == "cuda"
    model.to(device).train()
    model.set_dropout(cfg.dropout)
    fwd = torch.compile(model) if compile_model else model
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay, device)
    batcher = Batcher(data["train_text"], data["train_chat"], data["train_chat_offsets"], cfg.seq_len,
                      cfg.chat_frac, seed)
    val_rows = eval_windows(data["val_text"], cfg.seq_len)
    val_chat_rows = eval_windows(data["val_chat"], cfg.seq_len, data["val_chat_offsets"])
    ev_b = max(1, cfg.batch_size // 2)
    best = {"val_loss": float("inf"), "step": -1, "state": None}
    history = []
    t0 = time.time()
    step, train_loss, tokens = 0, float("nan"), 0
    while step < cfg.steps:
        elapsed = time.time() - t0
        if elapsed > time_cap_s:
            log(f"[target] time cap {time_cap_s:.0f}s reached at step {step}")
            break
        lr = lr_at(max(step / cfg.steps, elapsed / time_cap_s), step, cfg.warmup, cfg.lr, cfg.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        x = torch.from_numpy(batcher(cfg.batch_size)).to(device, non_blocking=True)
        with torch.autocast("cuda", torch.bfloat16, enabled=amp):
            logits, _, _ = fwd(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens += x[:, 1:].numel()
        if step % cfg.log_every == 0 or step == 1:
            train_loss = loss.item()
            log(f"[target] step {step}/{cfg.steps} loss {train_loss:.4f} lr {lr:.2e} "
                f"{tokens / (time.time() - t0):,.0f} tok/s {time.time() - t0:.0f}s")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            vl = eval_loss(model, val_rows, ev_b, device, amp)
            history.append({"step": step, "train_loss": loss.item(), "val_loss": vl,
                            "seconds": round(time.time() - t0, 1)})
            tag = ""
            if vl < best["val_loss"]:
                best.update(val_loss=vl, step=step,
                            state={k: v.detach().clone() for k, v in model.state_dict().items()})
                tag = " *"
            log(f"[target] eval step {step}: val loss {vl:.4f} ppl {math.exp(vl):.1f}{tag}")
            model.train()
    if best["state"] is None or step % cfg.eval_every != 0:
        vl = eval_loss(model, val_rows, ev_b, device, amp)
        history.append({"step": step, "train_loss": loss.item(), "val_loss": vl,
                        "seconds": round(time.time() - t0, 1)})
        if vl < best["val_loss"]:
            best.update(val_loss=vl, step=step,
                        state={k: v.detach().clone() for k, v in model.state_dict().items()})
    model.load_state_dict(best["state"])
    model.set_dropout(0.0)
    model.eval()
    val_chat = eval_loss(model, val_chat_rows, ev_b, device, amp) if len(val_chat_rows) else float("nan")
    res = {"steps_run": step, "steps_planned": cfg.steps, "best_step": best["step"],
           "val_loss": best["val_loss"], "val_ppl": math.exp(best["val_loss"]),
           "val_chat_loss": val_chat, "val_tokens": int(val_rows[:, 1:].size),
           "train_tokens_seen": tokens, "seconds": round(time.time() - t0, 1), "history": history}
    log(f"[target] done: best val loss {res['val_loss']:.4f} (ppl {res['val_ppl']:.1f}) at step "
        f"{best['step']}, val chat loss {val_chat:.4f}, {res['seconds']}s")
    return res


# ----------------------------------------------------------------------------------------------
# generation


@torch.no_grad()
def generate(model: TargetLM, given: torch.Tensor, given_len: torch.Tensor, total_len: int,
             temps: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """Rows of `total_len` tokens. Row r keeps given[r, :given_len[r]] (teacher-forced), then
    picks each next token greedily where temps[r, t] == 0 or samples at that temperature.
    Runs the model in its own dtype with a static KV cache (all rows share one length)."""
    model.eval()
    b = given.shape[0]
    dev = given.device
    p0 = int(given_len.min())
    ids = torch.zeros(b, total_len, dtype=torch.long, device=dev)
    ids[:, :given.shape[1]] = given[:, :total_len]
    dtype = model.model.embed_tokens.weight.dtype
    cache = model.new_cache(b, total_len, dtype, dev)
    logits, _, _ = model(ids[:, :p0], cache=cache)
    last = logits[:, -1]
    for t in range(p0, total_len):
        tt = temps[:, t]
        pick = last.float().argmax(-1)
        if bool((tt > 0).any()):
            probs = torch.softmax(last.float() / tt.clamp(min=1e-4)[:, None], -1)
            sampled = torch.multinomial(probs, 1, generator=gen)[:, 0]
            pick = torch.where(tt > 0, sampled, pick)
        ids[:, t] = torch.where(t < given_len, ids[:, t], pick)
        if t + 1 < total_len:
            lg, _ = model.decode(ids[:, t:t + 1], t, cache)
            last = lg[:, 0]
    return ids


def first_stop(ids: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Index of the first <eos>/<end_of_turn> at or after start per row (len if none)."""
    out = np.full(len(ids), ids.shape[1], dtype=np.int64)
    for r in range(len(ids)):
        hit = np.nonzero(np.isin(ids[r, start[r]:], EOS_IDS))[0]
        if len(hit):
            out[r] = start[r] + hit[0]
    return out
