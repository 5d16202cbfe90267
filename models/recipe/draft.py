"""Assistant (frozen-KV MTP draft) distillation on target rollouts, and acceptance simulation."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .arch import (DRAFT_POSITION, FULL, POSITION_OFFSETS, SLIDING, Assistant, TargetLM,
                   draft_all_positions, frozen_kv_masks, target_kv_for_draft)
from .data import BOS_ID, SOT_ID
from .target import first_stop, generate, lr_at, make_optimizer


def log(msg: str) -> None:
    print(msg, flush=True)


@dataclass
class DraftTrainCfg:
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_attention_heads: int = 4
    layer_types: list = field(default_factory=lambda: [SLIDING, FULL])
    unroll: int = 3                    # S draft steps, trained as served
    n_rollouts: int = 49152
    rollout_len: int = 320
    rollout_batch: int = 4096
    prompt_min: int = 8
    prompt_max: int = 128
    mode_probs: tuple = (0.45, 0.35, 0.20)   # text window / target-sampled prefix / chat prompt
    prompt_temp: float = 1.0           # temperature of the target-sampled prefixes
    cont_sample_frac: float = 0.15     # rows whose continuation is sampled (else greedy)
    cont_temp: float = 0.7
    batch_size: int = 128
    steps: int = 4000
    lr: float = 2e-3
    min_lr_frac: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.01
    ce_weight: float = 0.2             # + CE on the target argmax
    grad_clip: float = 1.0
    log_every: int = 50
    eval_every: int = 500


# ----------------------------------------------------------------------------------------------
# prompts and rollouts


def chat_prompts(chat: np.ndarray, offsets: np.ndarray, model_hdr: list[int], max_len: int) -> list:
    """Each conversation cut right after its first '<start_of_turn>model\\n' (a generation prompt)."""
    ends = np.append(offsets[1:], len(chat))
    out = []
    for s, e in zip(offsets, ends, strict=True):
        conv = chat[s:e]
        sots = np.nonzero(conv == SOT_ID)[0]
        if len(sots) < 2:
            continue
        cut = int(sots[1]) + 1 + len(model_hdr)
        if cut <= max_len and list(conv[sots[1] + 1:cut]) == model_hdr:
            out.append(conv[:cut].astype(np.int64))
    return out


def make_prompts(n: int, length: int, text: np.ndarray, chats: list, cfg: DraftTrainCfg,
                 rng: np.random.Generator):
    """given [n, length], given_len [n], start [n] (first on-policy index), temps [n, length]."""
    given = np.zeros((n, length), dtype=np.int64)
    given_len = np.zeros(n, dtype=np.int64)
    start = np.zeros(n, dtype=np.int64)
    temps = np.zeros((n, length), dtype=np.float32)
    modes = rng.choice(3, size=n, p=np.asarray(cfg.mode_probs) / sum(cfg.mode_probs))
    for r in range(n):
        p = int(rng.integers(cfg.prompt_min, cfg.prompt_max + 1))
        mode = modes[r] if (modes[r] != 2 or chats) else 0
        if mode == 2:
            pr = chats[int(rng.integers(len(chats)))]
            given[r, :len(pr)] = pr
            given_len[r] = start[r] = len(pr)
            continue
        if mode == 1:  # a few real tokens, then target-sampled text up to p
            s = int(rng.integers(2, 9))
            temps[r, s:p] = cfg.prompt_temp
        else:
            s = p
        i = int(rng.integers(0, len(text) - s))
        given[r, 0] = BOS_ID
        given[r, 1:s] = text[i:i + s - 1]
        given_len[r], start[r] = s, p
    cont = np.where(rng.random(n) < cfg.cont_sample_frac, cfg.cont_temp, 0.0).astype(np.float32)
    for r in range(n):
        temps[r, start[r]:] = cont[r]
    return given, given_len, start, temps


def build_rollouts(target: TargetLM, text: np.ndarray, chats: list, cfg: DraftTrainCfg, device,
                   seed: int, deadline: float) -> dict:
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    given, given_len, start, temps = make_prompts(cfg.n_rollouts, cfg.rollout_len, text, chats, cfg, rng)
    ids = np.zeros_like(given)
    t0, done = time.time(), 0
    for i in range(0, cfg.n_rollouts, cfg.rollout_batch):
        if time.time() > deadline and done:
            log(f"[rollouts] deadline reached after {done} rollouts")
            break
        sl = slice(i, i + cfg.rollout_batch)
        out = generate(target, torch.from_numpy(given[sl]).to(device),
                       torch.from_numpy(given_len[sl]).to(device), cfg.rollout_len,
                       torch.from_numpy(temps[sl]).to(device), gen)
        ids[sl] = out.cpu().numpy()
        done = min(cfg.n_rollouts, i + cfg.rollout_batch)
        log(f"[rollouts] {done}/{cfg.n_rollouts} {time.time() - t0:.0f}s")
    res = {"ids": ids[:done], "start": start[:done], "greedy": temps[:done, -1] == 0}
    res["on_policy_tokens"] = int(sum(cfg.rollout_len - s for s in res["start"]))
    res["seconds"] = round(time.time() - t0, 1)
    return res


# ----------------------------------------------------------------------------------------------
# distillation


def draft_loss(t_logits, d_logits: list, start: torch.Tensor, ce_weight: float):
    """KL(target || draft) (+ CE on the target argmax) per step; valid queries: committed length
    c >= the row's on-policy start (c >= 1), teacher position c+k-1 inside the row."""
    b, length, _ = t_logits.shape
    c = torch.arange(length, device=t_logits.device)
    t_logp = torch.log_softmax(t_logits.float(), -1)
    total, stats = 0.0, []
    for k, lg in enumerate(d_logits, 1):
        teacher = t_logp[:, k - 1:]
        valid = (c[None, :] >= start[:, None]) & (c[None, :] >= 1) & (c[None, :] + k - 1 < length)
        lg = lg[:, :length - k + 1]
        v = valid[:, :length - k + 1]
        d_logp = torch.log_softmax(lg.float(), -1)
        kl = (teacher.exp() * (teacher - d_logp)).sum(-1)
        tgt = teacher.argmax(-1)
        ce = -d_logp.gather(-1, tgt[..., None])[..., 0]
        n = v.sum().clamp(min=1)
        loss_k = ((kl + ce_weight * ce) * v).sum() / n
        total = total + loss_k
        acc = ((lg.argmax(-1) == tgt) & v).sum() / n
        stats.append((loss_k.detach(), acc.detach()))
    return total / len(d_logits), stats


def train_assistant(target: TargetLM, assistant: Assistant, rollouts: dict, cfg: DraftTrainCfg,
                    device, deadline: float, seed: int, monitor=None) -> dict:
    amp = device.type == "cuda"
    assistant.to(device).train()
    for p in target.parameters():
        p.requires_grad_(False)
    opt = make_optimizer(assistant, cfg.lr, cfg.weight_decay, device)
    rng = np.random.default_rng(seed)
    ids_all = torch.from_numpy(rollouts["ids"]).to(device)
    start_all = torch.from_numpy(rollouts["start"]).to(device)
    n, length = ids_all.shape
    masks = frozen_kv_masks(length, target.arch.sliding_window, device)
    offset = POSITION_OFFSETS[DRAFT_POSITION]
    kv_layers = tuple(target.kv_source.values())
    t0 = time.time()
    cap = max(1.0, deadline - t0)
    history = []
    step = 0
    while step < cfg.steps:
        elapsed = time.time() - t0
        if elapsed > cap:
            log(f"[assistant] deadline reached at step {step}")
            break
        lr = lr_at(max(step / cfg.steps, elapsed / cap), step, cfg.warmup, cfg.lr, cfg.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.from_numpy(rng.choice(n, size=min(cfg.batch_size, n), replace=False)).to(device)
        ids, start = ids_all[idx], start_all[idx]
        with torch.no_grad():
            t_logits, h, kvs = target(ids, kv_layers=kv_layers)
        with torch.autocast("cuda", torch.bfloat16, enabled=amp):
            d_logits = draft_all_positions(target, assistant, ids, h, target_kv_for_draft(target, kvs),
                                           cfg.unroll, offset, masks)
        loss, stats = draft_loss(t_logits, d_logits, start, cfg.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(assistant.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        if step % cfg.log_every == 0 or step == 1:
            accs = " ".join(f"{a.item():.3f}" for _, a in stats)
            log(f"[assistant] step {step}/{cfg.steps} loss {loss.item():.4f} top1-match/step [{accs}] "
                f"lr {lr:.2e} {time.time() - t0:.0f}s")
            history.append({"step": step, "loss": loss.item(), "match": [a.item() for _, a in stats]})
        if monitor is not None and step % cfg.eval_every == 0:
            assistant.eval()
            m = monitor(assistant)
            log(f"[assistant] eval step {step}: mean accept length {m:.3f}")
            assistant.train()
    assistant.eval()
    return {"steps_run": step, "steps_planned": cfg.steps, "seconds": round(time.time() - t0, 1),
            "history": history}


# ----------------------------------------------------------------------------------------------
# acceptance simulation (greedy, chain of S drafts, as the engine serves it)


@torch.no_grad()
def draft_matches(target: TargetLM, assistant: Assistant, ids: torch.Tensor, steps: int,
                  position_offset: int, batch: int) -> np.ndarray:
    """match[k-1, r, c]: draft step k from committed length c proposes ids[r, c+k] (the target's
    greedy token). Teacher forcing on the greedy path is exact for greedy verification: step k
    only matters if steps < k were accepted, i.e. equal to the path."""
    n, length = ids.shape
    out = np.zeros((steps, n, length), dtype=bool)
    masks = frozen_kv_masks(length, target.arch.sliding_window, ids.device)
    kv_layers = tuple(target.kv_source.values())
    for i in range(0, n, batch):
        x = ids[i:i + batch]
        _, h, kvs = target(x, kv_layers=kv_layers)
        outs = draft_all_positions(target, assistant, x, h, target_kv_for_draft(target, kvs), steps,
                                   position_offset, masks)
        for k, lg in enumerate(outs, 1):
            pred = lg[:, :length - k].argmax(-1)
            out[k - 1, i:i + batch, :length - k] = (pred == x[:, k:]).cpu().numpy()
    return out


def simulate_chain(match: np.ndarray, start: np.ndarray, stop: np.ndarray) -> dict:
    """Greedy speculative decoding from committed length start[r] (prefill done, bonus known):
    accept drafts while they match, commit accept_len = 1 + matches, repeat. A verify step at
    committed length c needs the S-token lookahead inside the row and c < the row's first stop."""
    steps, n, length = match.shape
    accepted = []
    for r in range(n):
        c = int(start[r])
        while c + steps < length and c < stop[r]:
            m = 0
            while m < steps and match[m, r, c]:
                m += 1
            accepted.append(m)
            c += m + 1
    a = np.asarray(accepted)
    if not len(a):
        return {"verify_steps": 0}
    return {
        "verify_steps": int(len(a)),
        "mean_accept_length": float((a + 1).mean()),
        "rate_at_position": [float((a >= k).mean()) for k in range(1, steps + 1)],
        "conditional_rate_at_position": [float((a >= k).sum() / max(1, (a >= k - 1).sum()))
                                         for k in range(1, steps + 1)],
        "accept_length_histogram": [int((a == m).sum()) for m in range(steps + 1)],
    }


def eval_prompts(val_text: np.ndarray, val_chats: list, n_text: int, n_chat: int, prompt_len: int,
                 seed: int):
    """Held-out prompts: <bos> + a window of a held-out play, and held-out chat turns."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in np.sort(rng.choice(len(val_text) - prompt_len, size=n_text, replace=False)):
        rows.append(np.concatenate([[BOS_ID], val_text[s:s + prompt_len - 1]]).astype(np.int64))
    kinds = ["text"] * len(rows)
    if val_chats and n_chat:
        for j in rng.choice(len(val_chats), size=min(n_chat, len(val_chats)), replace=False):
            rows.append(val_chats[j])
            kinds.append("chat")
    return rows, kinds


def acceptance_report(target: TargetLM, assistant: Assistant, prompts: list, kinds: list,
                      gen_len: int, steps: int, device, batch: int = 64) -> dict:
    """Greedy-generate from every prompt with the target, then simulate speculative decoding
    under both draft position conventions."""
    max_p = max(len(p) for p in prompts)
    length = max_p + gen_len
    given = np.zeros((len(prompts), length), dtype=np.int64)
    glen = np.asarray([len(p) for p in prompts])
    for r, p in enumerate(prompts):
        given[r, :len(p)] = p
    ids = []
    for i in range(0, len(prompts), batch):
        sl = slice(i, i + batch)
        ids.append(generate(target, torch.from_numpy(given[sl]).to(device),
                            torch.from_numpy(glen[sl]).to(device), length,
                            torch.zeros(len(given[sl]), length, device=device)))
    ids = torch.cat(ids)
    ids_np = ids.cpu().numpy()
    stop = np.minimum(first_stop(ids_np, glen), glen + gen_len)  # gen_len new tokens per prompt
    kinds = np.asarray(kinds)
    report = {"prompts": {k: int((kinds == k).sum()) for k in ("text", "chat")},
              "generated_tokens": int(sum(min(stop[r] + 1, length) - glen[r] for r in range(len(glen))))}
    for name, off in POSITION_OFFSETS.items():
        match = draft_matches(target, assistant, ids, steps, off, batch)
        rep = {"all": simulate_chain(match, glen, stop)}
        for k in ("text", "chat"):
            sel = kinds == k
            if sel.any():
                rep[k] = simulate_chain(match[:, sel], glen[sel], stop[sel])
        report[name] = rep
    report["sample_ids"] = ids_np[:2].tolist()
    return report


def monitor_fn(target: TargetLM, prompts: list, kinds: list, gen_len: int, steps: int, device):
    """Cheap acceptance probe during training (greedy paths generated once)."""
    max_p = max(len(p) for p in prompts)
    length = max_p + gen_len
    given = np.zeros((len(prompts), length), dtype=np.int64)
    glen = np.asarray([len(p) for p in prompts])
    for r, p in enumerate(prompts):
        given[r, :len(p)] = p
    ids = generate(target, torch.from_numpy(given).to(device), torch.from_numpy(glen).to(device),
                   length, torch.zeros(len(prompts), length, device=device))
    stop = first_stop(ids.cpu().numpy(), glen)
    off = POSITION_OFFSETS[DRAFT_POSITION]

    def run(assistant):
        with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
            m = draft_matches(target, assistant, ids, steps, off, 64)
        return simulate_chain(m, glen, stop).get("mean_accept_length", math.nan)

    return run
