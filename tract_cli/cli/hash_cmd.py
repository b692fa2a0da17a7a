"""`tract hash`: print a prompt's block hashes, one hex line per full block."""
from __future__ import annotations

import json
import pathlib
from typing import List, Optional

import typer

from tract_cli.cli import render
from tract_cli.core.errors import UsageError
from tract_cli.core.geometry import DEFAULT_BLOCK_TOKENS, load_model
from tract_cli.core.hashing import block_hashes, pool_root, tract_root


def _read_tokens(args: list[str], tokens_file: str | None) -> list[int]:
    if tokens_file:
        try:
            text = pathlib.Path(tokens_file).read_text()
        except OSError as exc:
            raise UsageError(f"cannot read {tokens_file}: {exc.strerror}",
                             "give an existing file of token ids") from None
        text = text.strip()
        if text.startswith("["):
            try:
                items = [str(x) for x in json.loads(text)]
            except ValueError:
                raise UsageError(f"{tokens_file} is not a JSON list of token ids",
                                 "write [1, 2, 3] or whitespace-separated ids") from None
        else:
            items = text.replace(",", " ").split()
        args = list(args) + items
    try:
        tokens = [int(a) for a in args]
    except ValueError as exc:
        raise UsageError(f"token ids must be integers ({exc})", "pass ids like 128000 9906") from None
    if any(t < 0 or t > 2**31 - 1 for t in tokens):
        raise UsageError("token ids must be in 0..2^31-1", "check the tokenizer output")
    return tokens


def hash_(
    tokens: Optional[List[str]] = typer.Argument(None, help="Token ids."),
    tokens_file: Optional[str] = typer.Option(None, "--tokens-file", help="File of token ids."),
    scheme: str = typer.Option("tract", "--scheme", help="tract|vllm."),
    block_tokens: int = typer.Option(DEFAULT_BLOCK_TOKENS, "--block-tokens", help="Tokens per block."),
    salt: Optional[str] = typer.Option(None, "--salt", help="Per-tenant salt."),
    pool: Optional[str] = typer.Option(None, "--pool", help="Use this region's scheme, seed and model."),
    model: str = typer.Option("llama-3-8b", "--model", help="Model fingerprint (tract, no --pool)."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON list."),
) -> None:
    """Print the chained block hashes of a prompt, one hex line per full block."""
    ids = _read_tokens(tokens or [], tokens_file)
    if not ids:
        raise UsageError("no token ids given", "pass ids as arguments or --tokens-file")
    root = None
    if pool:
        from tract_cli.core.pool import Pool
        with Pool.attach(pool, readonly=True, prefault=False) as p:
            scheme, block_tokens = p.info.hash_scheme, p.info.geometry.block_tokens
            root = pool_root(p.info, salt)
    elif scheme == "tract":
        root = tract_root(model_fingerprint=load_model(model).fingerprint(), salt=salt)
    hashes = [row.tobytes().hex() for row in
              block_hashes(ids, scheme, block_tokens, root=root,
                           salt=salt if scheme == "vllm" else None)]
    if json_out:
        render.print_json({"scheme": scheme, "block_tokens": block_tokens, "tokens": len(ids),
                           "hashes": hashes})
        return
    for h in hashes:
        print(h)
