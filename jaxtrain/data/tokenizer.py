"""Tokenizers behind one interface: bytes, or a Hugging Face tokenizer.json.

`fingerprint` identifies a tokenizer by content (a prepared directory records it, so training
with another tokenizer is refused); `document_ids` is how every source turns one document's
ids into stored tokens: BOS + ids + EOS (BOS left out when it is the EOS, GPT-2 style).
"""
from __future__ import annotations

import functools
import hashlib
import pathlib
from typing import Optional, Sequence

import numpy as np

from jaxtrain.config import padded_vocab
from jaxtrain.data.errors import DataError


class Tokenizer:
    """Common interface: encode/decode, special ids, vocab_size (ids used)."""
    name: str
    bos_id: int
    eos_id: int
    pad_id: int
    vocab_size: int
    fingerprint: str  # identifies the tokenizer by content, not by where its file lives

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab(self.vocab_size, tensor=1)  # Megatron's rounding, as the model

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(self.encode(t), np.int64) for t in texts]

    @property
    def token_dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def document_ids(self, ids: np.ndarray) -> np.ndarray:
        """One document's stored tokens: BOS + ids + EOS (no BOS when BOS is the EOS)."""
        head = [self.bos_id] if self.bos_id != self.eos_id else []
        dtype = self.token_dtype
        return np.concatenate([np.asarray(head, dtype), np.asarray(ids).astype(dtype),
                               np.asarray([self.eos_id], dtype)])


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255, then BOS=256, EOS=257, PAD=258."""
    name = "byte"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    fingerprint = "byte"


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`; special tokens found by their usual names."""

    def __init__(self, path: str):
        import tokenizers  # the only user of this dependency
        self.name = path
        try:
            raw = pathlib.Path(path).read_bytes()
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise DataError(f"data.tokenizer={path}: not a readable Hugging Face tokenizer.json "
                            f"({e})") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        eos = self._find(_EOS_NAMES)
        if eos is None:
            raise DataError(f"data.tokenizer={path} has no end-of-text token (looked for "
                            f"{', '.join(_EOS_NAMES)}); add one to the tokenizer")
        bos = self._find(_BOS_NAMES)
        pad = self._find(_PAD_NAMES)
        self.eos_id = eos
        self.bos_id = eos if bos is None else bos
        self.pad_id = eos if pad is None else pad
        self.fingerprint = "sha256:" + hashlib.sha256(raw).hexdigest()

    def _find(self, names: Sequence[str]) -> Optional[int]:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int64) for e in encs]


@functools.lru_cache(maxsize=4)
def _load_hf_tokenizer(path: str, mtime_ns: int) -> HFTokenizer:
    del mtime_ns  # cache key: a rewritten file is read again
    return HFTokenizer(path)


def make_tokenizer(data_cfg) -> Tokenizer:
    """`data.tokenizer`: "byte", a tokenizer.json, or a folder holding one."""
    return tokenizer_from_spec(data_cfg.tokenizer)


def tokenizer_from_spec(spec: str) -> Tokenizer:
    if spec == "byte":
        return ByteTokenizer()
    path = pathlib.Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"data.tokenizer={spec}: no such file; use 'byte' or the path of a "
                        "Hugging Face tokenizer.json (or its folder)")
    return _load_hf_tokenizer(str(path.resolve()), path.stat().st_mtime_ns)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(
            f"tokenizer {tokenizer.name} uses {tokenizer.vocab_size} ids but model.vocab_size="
            f"{model_vocab_size}; set model.vocab_size={tokenizer.padded_vocab_size} (its size "
            "rounded up to a multiple of 128)")
