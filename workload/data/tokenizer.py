"""The tokenizer of text data (`training.data.tokenizer`): a Hugging Face `tokenizer.json` (the
`tokenizers` library) or a SentencePiece `.model`, chosen by the file's name; a directory means its
tokenizer.json, else its tokenizer.model. Local or any fsspec URL (gs://), read whole once, at most
MAX_TOKENIZER_BYTES.

A document's tokens are the tokenizer's encoding of its text (Hugging Face: with the tokenizer's own
post-processor, so with a BOS where the tokenizer adds one; SentencePiece: as `encode` gives them, no
BOS) followed by one end-of-sequence token, which the packed loss then learns to predict after the
text (none is added where the encoding already ends with it). That EOS is `data.eosId` when set, else
the tokenizer's own (SentencePiece's `eos_id`; Hugging Face: the `eos_token` of the
tokenizer_config.json beside tokenizer.json); where both exist they must agree.

Encoding is thread-safe in both libraries and the read-ahead workers are threads, so one Tokenizer per
process serves them all: it is loaded once, before the workers start.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import fsspec
import numpy as np

from ..process.exits import UserError

# A tokenizer file: Gemma 3's tokenizer.json, the largest common one, has 33 MB.
MAX_TOKENIZER_BYTES = 64 << 20
# tokenizer_config.json and chat_template.jinja beside it.
MAX_CONFIG_BYTES = 4 << 20


def _read(path: str, limit: int, what: str) -> bytes:
    with fsspec.open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UserError(f"{what}: {path} has more than {limit} bytes")
    return bytes(data)


def read_optional(path: str, limit: int, what: str) -> bytes | None:
    fs, root = fsspec.core.url_to_fs(path)
    return _read(path, limit, what) if fs.exists(root) else None


def resolve(path: str) -> str:
    """The tokenizer file `path` names: itself, or a directory's tokenizer.json, else its tokenizer.model."""
    if path.endswith((".json", ".model")):
        return path
    fs, root = fsspec.core.url_to_fs(path)
    for name in ("tokenizer.json", "tokenizer.model"):
        if fs.exists(root.rstrip("/") + "/" + name):
            return path.rstrip("/") + "/" + name
    raise UserError(
        f"training.data.tokenizer: {path} is not a tokenizer.json (Hugging Face) or .model "
        "(SentencePiece) file, nor a directory holding one"
    )


class Tokenizer:
    """Text -> token ids, the same in every process and thread (see the module's docstring)."""

    def __init__(self, path: str, eos_id: int | None = None):
        self.path = resolve(path)
        what = "training.data.tokenizer"
        data = _read(self.path, MAX_TOKENIZER_BYTES, what)
        base = self.path.rsplit("/", 1)[0]
        config_raw = read_optional(base + "/tokenizer_config.json", MAX_CONFIG_BYTES, what)
        try:
            config = json.loads(config_raw) if config_raw else {}
        except ValueError as e:
            raise UserError(f"{what}: {base}/tokenizer_config.json is not JSON: {e}") from None
        self.config = config if isinstance(config, dict) else {}
        if self.path.endswith(".model"):
            import sentencepiece

            self._sp = sentencepiece.SentencePieceProcessor()
            try:
                self._sp.LoadFromSerializedProto(data)
            except Exception as e:  # the library raises RuntimeError or OSError on a bad model
                raise UserError(f"{what}: {self.path} is not a SentencePiece model: {e}") from None
            self._hf = None
            self.vocab_size = int(self._sp.get_piece_size())
            own = int(self._sp.eos_id())
            own_eos = own if own >= 0 else None
        else:
            import tokenizers

            try:
                self._hf = tokenizers.Tokenizer.from_str(data.decode())
            except Exception as e:  # the library raises its own Exception on a bad file
                raise UserError(f"{what}: {self.path} is not a Hugging Face tokenizer.json: {e}") from None
            self._sp = None
            vocab = self._hf.get_vocab(with_added_tokens=True)
            self.vocab_size = max(vocab.values()) + 1 if vocab else 0
            own_eos = self._config_token_id("eos_token")
        if eos_id is not None and own_eos is not None and eos_id != own_eos:
            raise UserError(
                f"training.data.eosId: {eos_id}, but the tokenizer's end-of-sequence token is {own_eos} "
                f"({self.path}); leave eosId unset or make them agree"
            )
        eos = eos_id if eos_id is not None else own_eos
        if eos is None:
            raise UserError(
                f"training.data.eosId: required, the tokenizer {self.path} declares no end-of-sequence token"
            )
        if eos >= self.vocab_size:
            raise UserError(f"training.data.eosId: {eos} is not a token of {self.path} ({self.vocab_size} tokens)")
        self.eos_id = eos

    def _config_token_id(self, key: str) -> int | None:
        token = self.config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if not isinstance(token, str) or self._hf is None:
            return None
        found = self._hf.token_to_id(token)
        return None if found is None else int(found)

    def check_fits(self, vocab: int) -> None:
        """Refuse a tokenizer whose ids do not all fit the model's embedding."""
        if self.vocab_size > vocab:
            raise UserError(
                f"training.data.tokenizer: {self.path} has {self.vocab_size} tokens, more than "
                f"model.vocab ({vocab}); raise model.vocab or use a smaller tokenizer"
            )

    def _ends(self, ids: list[int]) -> np.ndarray:
        if not ids or ids[-1] != self.eos_id:
            ids = ids + [self.eos_id]
        return np.asarray(ids, np.int32)

    def encode(self, text: str) -> np.ndarray:
        """A document's tokens: the encoding of `text`, then the EOS (int32)."""
        if self._hf is not None:
            return self._ends(self._hf.encode(text).ids)
        assert self._sp is not None
        return self._ends(self._sp.encode(text))

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(the encoding of `text` without the post-processor's special tokens and without an EOS, each
        token's first character in `text`): how chat.py encodes a rendered conversation."""
        if self._hf is None:
            raise UserError(
                f"training.objective: sft needs a Hugging Face tokenizer.json (with a chat template), not {self.path}"
            )
        encoding = self._hf.encode(text, add_special_tokens=False)
        starts = np.asarray([a for a, _ in encoding.offsets], np.int64).reshape(-1)
        return np.asarray(encoding.ids, np.int32), starts

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each of `texts`, the encodings batched in the library's own threads."""
        if self._hf is not None:
            return [self._ends(e.ids) for e in self._hf.encode_batch(list(texts))]
        assert self._sp is not None
        return [self._ends(ids) for ids in self._sp.encode(list(texts))]
