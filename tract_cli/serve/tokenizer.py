"""Tokenizers of the reference engine.

`ByteTokenizer` serves the random-weight model: one token per UTF-8 byte
(0..255) plus BOS (256), EOS (257) and PAD (258), so any text round-trips and
nothing has to be downloaded.  `HFTokenizer` reads a checkpoint's
`tokenizer.json` with the `tokenizers` library (the `serve` extra).
"""
from __future__ import annotations

import json
import pathlib

from tract_cli.core.errors import UsageError


class ByteTokenizer:
    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 259

    bos_id = BOS
    eos_id = EOS

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` with the checkpoint's BOS/EOS ids."""

    def __init__(self, path: pathlib.Path, bos_id: int | None, eos_id: int | None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UsageError("loading a checkpoint's tokenizer needs the `tokenizers` package",
                             'pip install "tract-cxl[serve]"') from None
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:        # the Rust library raises its own exception type
            raise UsageError(f"cannot read tokenizer {path}: {exc}",
                             "pass a checkpoint directory with a valid tokenizer.json") from None
        self.bos_id, self.eos_id = bos_id, eos_id
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + list(ids)

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_dir: pathlib.Path, config: dict):
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"{model_dir} has no tokenizer.json",
                         "pass a Hugging Face checkpoint directory that includes its tokenizer")
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return HFTokenizer(path, config.get("bos_token_id"), eos)


def read_json(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}", "check the path") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}", "fix or replace the file") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} must hold a JSON object", "fix or replace the file")
    return data
