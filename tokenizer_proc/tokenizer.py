"""The tokenizer as the HTTP front sees it: HF ``tokenizer.json`` through the ``tokenizers`` library.

We do not use ``transformers`` here (it would pull torch-adjacent imports and is slow to load);
``tokenizer_config.json`` supplies what ``tokenizer.json`` lacks: the BOS/EOS token *strings*,
``add_bos_token`` and the chat template (see ``chat_template.py``).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Sequence

from tokenizers import Tokenizer

from common.hf_files import read_json, special_token


class TokenizerError(RuntimeError):
    """The tokenizer directory cannot be used; the message is one line for the supervisor."""


class TextTokenizer:
    """Encode/decode plus the special-token facts the front needs."""

    SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")

    def __init__(self, tokenizer_dir: str):
        path = os.path.join(tokenizer_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"no tokenizer.json in {tokenizer_dir!r}")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as exc:  # the tokenizers library raises plain Exception subclasses
            raise TokenizerError(f"cannot load {path}: {exc}") from exc
        self.dir = tokenizer_dir
        self.config = read_json(os.path.join(tokenizer_dir, "tokenizer_config.json"))
        self.special_tokens: dict[str, str] = self._special_token_strings()
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_id = self.token_to_id(self.bos_token)
        self.eos_id = self.token_to_id(self.eos_token)
        # None means "whatever tokenizer.json's post-processor does" (the HF default for fast tokenizers).
        add_bos = self.config.get("add_bos_token")
        self.add_bos_token: bool | None = add_bos if isinstance(add_bos, bool) else None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        # No token covers more input characters than its longest vocabulary entry has (byte-level
        # and metaspace entries spend one character per input byte or character; "##" and
        # "<0x..>" forms only overstate it). Bounds the text a number of tokens can hold.
        self.max_token_chars = max((len(t) for t in self.tok.get_vocab(with_added_tokens=True)), default=1)
        self._decode_one = lru_cache(maxsize=65536)(self._decode_one_uncached)
        self._special_added = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}

    # ------------------------------------------------------------------ facts
    def _special_token_strings(self) -> dict[str, str]:
        out: dict[str, str] = {}
        special_map = read_json(os.path.join(self.dir, "special_tokens_map.json"))
        for key in self.SPECIAL_KEYS:
            value = special_token(self.config, special_map, key)
            if value is not None:
                out[key] = value
        return out

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    def is_special(self, token: str) -> bool:
        """An added token marked special: decoding with ``skip_special_tokens`` drops its text."""
        return token in self._special_added

    def max_text_chars(self, max_tokens: int) -> int:
        """A text longer than this has more than ``max_tokens`` tokens, whatever it says (x4: room
        for normalizers that shrink text, such as NFKC composition)."""
        return max_tokens * max(1, self.max_token_chars) * 4 + 16

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_id is not None:
            # Some tokenizer.json files lack the post-processor that tokenizer_config promises.
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _decode_one_uncached(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def token_str(self, token_id: int) -> str:
        """The text of one token on its own, for logprob entries (cached: the vocabulary is finite)."""
        return self._decode_one(int(token_id))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.tok.id_to_token(int(i)) or "" for i in ids]
