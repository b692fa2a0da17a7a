"""A tiny random-weight Llama checkpoint and tokenizer for real-vLLM tests.

Made locally in about a second (nothing from a hub): transformers' Llama with
2 layers, hidden 128, 4 query heads over 2 KV heads of head_dim 32 (one of the
CPU attention backend's head sizes) in bf16, and a byte-level BPE trained by
`tokenizers` on a few lines.

Its weights are drawn (seeded) so that the answer depends on the KV it reads:
transformers' own init (std 0.02) gives nearly uniform attention whose output
barely reaches the logits (top logprobs within a few hundredths of each other), so
a garbled or misplaced block of the loaded KV left the greedy text unchanged.
Here the query and key projections are scaled (QK_STD: attention logits spread
over several units, each query weighs few keys); embeddings, values, attention
output and MLP keep the residual stream at unit scale, so attention decides the
last hidden state; the LM head spreads the logits (the top token's logprob is
about -1.7).  Measured in vLLM (tests/vllm_stack.py compares answers by their
top-20 logprobs): one wrong block of a 400-token prompt, any of its middle blocks,
moves the answer by 0.16 nats at least, 1.2 in the median, and changes the greedy
text itself in 160 of 176 cases.

Whole-block permutations are invisible to any model: vLLM caches keys after
RoPE, so the keys carry their positions, and attention is a sum over the set of
(key, value) pairs.  Swapping the payload of two blocks (K and V together) leaves
the answer exactly unchanged; it is a bug only for a later prefix-cache hit.

Run in the vLLM environment: `python tests/vllm_model.py DIR`.  A larger one, for
measuring a KV path where the compute is not almost free: `python
tests/vllm_model.py DIR --layers 8 --hidden 512 --heads 8 --kv-heads 4` (the
same scales, relative to the hidden size, so its attention is as sharp).
"""
from __future__ import annotations

import argparse
import math

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "CXL shared memory lets every host in a rack load and store the same bytes.",
    "Prefill computes the prompt's KV cache; decode reads it one token at a time.",
    "A prefix cache reuses the KV blocks of prompts that start alike.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]

# The scales at hidden size 128; another hidden size scales QK, VO and LM by
# sqrt(128 / hidden), which keeps the logits' and the residual stream's spread.
BASE_HIDDEN = 128
EMBED_STD = 1.0      # residual stream at unit scale
QK_STD = 0.2         # attention logits' std ~ 128 * QK_STD**2 ~ 5: sharp attention
VO_STD = 0.088       # 1/sqrt(hidden): values, attention output and MLP keep the scale
LM_STD = 0.2         # logits' std ~ 2.3: a peaked next-token distribution


def _init_weights(model, seed: int, hidden: int) -> None:
    """Draws every weight matrix (norm weights stay 1) from one seeded generator,
    in fp32 then cast, so the checkpoint is the same on every machine and run."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    scale = math.sqrt(BASE_HIDDEN / hidden)     # exactly 1.0 at the default size
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = (EMBED_STD if "embed_tokens" in name else
                   QK_STD * scale if ("q_proj" in name or "k_proj" in name) else
                   LM_STD * scale if name.startswith("lm_head") else VO_STD * scale)
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def make_checkpoint(out_dir: str, layers: int = 2, hidden: int = 128, heads: int = 4,
                    kv_heads: int = 2, vocab: int = 512, seed: int = 0) -> str:
    """Writes a random-weight Llama checkpoint with its tokenizer to OUT_DIR."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)

    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden,
                      intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=hidden // heads, max_position_embeddings=8192,
                      bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
                      torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg)
    _init_weights(model, seed, hidden)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


# the head sizes vLLM 0.32's CPU attention backend takes (cpu_attn.py)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def main() -> None:
    parser = argparse.ArgumentParser(description="Writes a random-weight Llama checkpoint.")
    parser.add_argument("dir")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args()
    if min(args.layers, args.hidden, args.heads, args.kv_heads) < 1:
        parser.error("--layers, --hidden, --heads and --kv-heads must be positive")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    if args.hidden // args.heads not in CPU_HEAD_SIZES:
        parser.error(f"--hidden / --heads is the head size, {args.hidden // args.heads}; vLLM's "
                     f"CPU attention takes {', '.join(map(str, CPU_HEAD_SIZES))}")
    print(make_checkpoint(args.dir, layers=args.layers, hidden=args.hidden,
                          heads=args.heads, kv_heads=args.kv_heads))


if __name__ == "__main__":
    main()
