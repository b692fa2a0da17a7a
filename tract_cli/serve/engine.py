"""The reference engine: prefill, decode steps and sampling over a block table.

Prefill runs one block (`block_tokens` positions) per forward pass, aligned
to block boundaries.  That makes its arithmetic independent of where a
prefill starts: CPU matrix kernels give bit-different rows for different
row counts, so a prefill that skips a cached prefix and one that computes
everything must run the same shapes for the answers to be token-for-token
identical.  With block-aligned chunks they do, by construction.

All torch compute of a process runs on one long-lived compute thread (the
engine's "stream"): on CPUs, torch's OpenMP team belongs to the thread that
created it, and once a second thread had run a parallel op (even a large
torch.zeros), compute ran 2-3x slower here.  Requests of an HTTP worker
therefore share that thread, a step at a time, and private KV buffers are
allocated on it too.

Sampling is greedy at temperature 0; otherwise each step draws from its own
generator seeded by (seed, step), so a request's tokens do not depend on
which process sampled which step.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import pathlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tract_cli.core.errors import UsageError
from tract_cli.core.geometry import ModelProfile, checkpoint_profile, load_model
from tract_cli.core.weights import weights_fingerprint
from tract_cli.serve.kvcache import POOL, PRIVATE, BlockTable, private_blocks
from tract_cli.serve.model import LlamaModel, ModelConfig
from tract_cli.serve.tokenizer import ByteTokenizer, load_tokenizer, read_json

DEFAULT_MODEL = "tiny-llama"

_compute = ThreadPoolExecutor(1, thread_name_prefix="tract-compute")
_compute_ident: list[int] = []


def _mark_compute_thread():
    _compute_ident.append(threading.get_ident())


_compute.submit(_mark_compute_thread).result()


def on_compute_thread(fn):
    """Runs FN on the process's compute thread (directly if already there)."""
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        if threading.get_ident() == _compute_ident[0]:
            return fn(*args, **kw)
        return _compute.submit(fn, *args, **kw).result()
    return wrapper


@dataclass
class Sampling:
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int = 0


class Engine:
    def __init__(self, model: LlamaModel, tokenizer, profile: ModelProfile,
                 identity: bytes = bytes(32)):
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.profile = profile
        # what the weights are (32 bytes): every pool key of this engine carries it
        # (serve/worker.py), so engines of one geometry never share a block
        self.identity = identity
        self.block_tokens = self.cfg.block_tokens
        self.block_shape = self.cfg.geometry.block_shape
        if tokenizer.vocab_size > self.cfg.vocab_size:
            raise UsageError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model "
                             f"{self.cfg.vocab_size}", "use the tokenizer of this checkpoint")

    @classmethod
    @on_compute_thread
    def load(cls, model_dir: str | None = None, profile: str = DEFAULT_MODEL,
             seed: int = 0) -> "Engine":
        """A checkpoint from MODEL_DIR, or seeded random weights for PROFILE."""
        if model_dir:
            path = pathlib.Path(model_dir)
            model = LlamaModel.from_checkpoint(path)
            config = read_json(path / "config.json")
            tokenizer = load_tokenizer(path, config)
            prof = checkpoint_profile(path)
            _, _, weights = weights_fingerprint(str(path))
            ident = hashlib.sha256(b"tract-engine-v1|checkpoint|" + weights.encode() + b"|" +
                                   json.dumps(config, sort_keys=True).encode()).digest()
            return cls(model, tokenizer, prof, ident)
        prof = load_model(profile)
        model = LlamaModel.random(ModelConfig.from_profile(prof), seed)
        if model.cfg.vocab_size < ByteTokenizer.vocab_size:
            raise UsageError(f"model {prof.name} has {model.cfg.vocab_size} tokens; the byte "
                             f"tokenizer needs {ByteTokenizer.vocab_size}", "use tiny-llama")
        ident = hashlib.sha256(f"tract-engine-v1|random|{prof.name}|{prof.geometry.describe()}|"
                               f"{seed}".encode()).digest()
        return cls(model, ByteTokenizer(), prof, ident)

    # ---- KV storage ----

    @on_compute_thread
    def new_table(self, total_tokens: int, pool_store: torch.Tensor | None = None,
                  private: int | None = None) -> BlockTable:
        """A block table with a private buffer for PRIVATE blocks (default: enough
        for TOTAL_TOKENS)."""
        count = private if private is not None else math.ceil(total_tokens / self.block_tokens)
        return BlockTable(private_blocks(max(count, 1), self.block_shape,
                                         self.cfg.kv_torch_dtype), pool_store)

    def grow(self, table: BlockTable, tokens: int, next_private: list[int]) -> None:
        """Appends private blocks until TABLE holds TOKENS positions."""
        need = -(-tokens // self.block_tokens) - len(table)
        if need <= 0:
            return
        first = next_private[0]
        if first + need > table.stores[PRIVATE].shape[0]:
            raise UsageError("the request outgrew its KV buffer", "lower max_tokens")
        table.extend(PRIVATE, range(first, first + need))
        next_private[0] = first + need

    # ---- compute ----

    @on_compute_thread
    def prefill(self, tokens, table: BlockTable, start_block: int = 0) -> torch.Tensor:
        """Computes positions start_block*block_tokens.. of TOKENS, one block per
        pass; returns the logits of the last token."""
        ids = torch.as_tensor(tokens, dtype=torch.long)
        bt = self.block_tokens
        if not 0 <= start_block * bt < len(ids):
            raise ValueError("a prefill must compute at least the last token")
        logits = None
        for s in range(start_block * bt, len(ids), bt):
            logits = self.model.forward(ids[s:s + bt], s, table)
        return logits

    @on_compute_thread
    def step(self, token: int, pos: int, table: BlockTable) -> torch.Tensor:
        return self.model.forward(torch.tensor([token]), pos, table)

    def sample(self, logits: torch.Tensor, sampling: Sampling, step: int) -> int:
        if sampling.temperature <= 0:
            return int(torch.argmax(logits))
        gen = torch.Generator().manual_seed((sampling.seed * 1_000_003 + step) % (2**63))
        probs = torch.softmax(logits / sampling.temperature, -1)
        return int(torch.multinomial(probs, 1, generator=gen))

    def decode(self, first: int, prompt_len: int, table: BlockTable, sampling: Sampling,
               next_private: list[int]):
        """Yields the generated tokens: FIRST (sampled by prefill), then one per
        step until max_tokens or EOS."""
        token, pos = first, prompt_len
        for step in range(sampling.max_tokens):
            yield token
            if token == self.tokenizer.eos_id or step + 1 == sampling.max_tokens:
                return
            self.grow(table, pos + 1, next_private)
            token = self.sample(self.step(token, pos, table), sampling, step + 1)
            pos += 1

    def generate(self, tokens, sampling: Sampling) -> list[int]:
        """The single-process reference: prefill and decode in this process."""
        total = len(tokens) + sampling.max_tokens
        table = self.new_table(total)
        nxt = [0]
        self.grow(table, len(tokens), nxt)
        first = self.sample(self.prefill(tokens, table), sampling, 0)
        return list(self.decode(first, len(tokens), table, sampling, nxt))

    def check_prompt(self, tokens, max_tokens: int, max_context: int | None = None) -> None:
        """Raises UsageError for a prompt this engine cannot serve."""
        limit = min(self.cfg.max_positions, max_context or self.cfg.max_positions)
        if not tokens:
            raise UsageError("the prompt is empty", "send at least one token")
        if any((not isinstance(t, int)) or t < 0 or t >= self.cfg.vocab_size for t in tokens):
            raise UsageError(f"token ids must be integers in 0..{self.cfg.vocab_size - 1}",
                             "tokenize with this model's tokenizer")
        if len(tokens) + max_tokens > limit:
            raise UsageError(f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"the context of {limit} tokens", "shorten the prompt or max_tokens")


__all__ = ["DEFAULT_MODEL", "Engine", "POOL", "PRIVATE", "Sampling"]
