"""A tiny random-weight Llama checkpoint and tokenizer for real-vLLM tests.

Made locally in about a second (nothing from a hub): transformers' Llama with
a few small layers in bf16, and a byte-level BPE trained by `tokenizers` on a
few lines.  head_dim 32 is one of the CPU attention backend's head sizes.

Run in the vLLM environment: `python tests/vllm_model.py DIR`.
"""
from __future__ import annotations

import sys

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "CXL shared memory lets every host in a rack load and store the same bytes.",
    "Prefill computes the prompt's KV cache; decode reads it one token at a time.",
    "A prefix cache reuses the KV blocks of prompts that start alike.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


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
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/vllm_model.py DIR")
    print(make_checkpoint(sys.argv[1]))
