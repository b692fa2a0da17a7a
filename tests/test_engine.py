"""The reference engine: block-aligned prefill is independent of where it starts,
pool-slot KV gives the same answers as private KV, and checkpoints in the
Hugging Face layout (written here) load, with bad ones refused in one line."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch

from tract_cli.core.errors import UsageError
from tract_cli.core.pool import Pool
from tract_cli.serve.checkpoint import read_safetensors, write_safetensors
from tract_cli.serve.engine import Engine, Sampling
from tract_cli.serve.kvcache import POOL, PRIVATE
from tract_cli.serve.model import LlamaModel, ModelConfig


@pytest.fixture(scope="module")
def engine():
    return Engine.load()


def _table(engine, n_tokens):
    t = engine.new_table(n_tokens)
    engine.grow(t, n_tokens, [0])
    return t


def test_prefill_from_any_cached_block_is_bit_identical(engine):
    tokens = [int(x) for x in torch.randint(0, 256, (83,), generator=torch.Generator().manual_seed(1))]
    ref = _table(engine, len(tokens))
    want = engine.prefill(tokens, ref)
    for start in range(0, (len(tokens) - 1) // 16 + 1):
        t = _table(engine, len(tokens))
        t.stores[PRIVATE][:start] = ref.stores[PRIVATE][:start]
        assert torch.equal(engine.prefill(tokens, t, start), want), start
        assert torch.equal(t.stores[PRIVATE][:len(t)], ref.stores[PRIVATE][:len(ref)])


def test_kv_in_pool_slots_gives_the_same_logits(engine, region_path):
    tokens = list(range(1, 41))
    ref = _table(engine, len(tokens))
    want = engine.prefill(tokens, ref)
    with Pool.create(region_path, 16 << 20, "tiny-llama") as pool:
        slots = pool.slots_tensor()
        t = engine.new_table(len(tokens), slots)
        t.extend(POOL, [7, 3])               # two full blocks in pool slots, out of order
        t.append(PRIVATE, 0)                 # the tail in private memory
        assert torch.equal(engine.prefill(tokens, t), want)
        assert torch.equal(slots[7], ref.stores[PRIVATE][0]) and torch.equal(slots[3], ref.stores[PRIVATE][1])
        t.release()
        del slots


def test_generation_is_deterministic_and_sampling_seeded(engine):
    p = engine.tokenizer.encode("deterministic")
    assert engine.generate(p, Sampling(10)) == engine.generate(p, Sampling(10))
    a = engine.generate(p, Sampling(10, 1.0, 1))
    assert a == engine.generate(p, Sampling(10, 1.0, 1))
    assert a != engine.generate(p, Sampling(10, 1.0, 2))


def test_block_writes_never_cross_a_block(engine):
    t = _table(engine, 32)
    with pytest.raises(ValueError, match="block boundary"):
        t.write(0, 8, torch.zeros(16, 2, 32), torch.zeros(16, 2, 32))


# ---- checkpoints ----

def _write_checkpoint(d, model: LlamaModel, dtype="F32", tie=False):
    c = model.cfg
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "intermediate_size": c.intermediate_size,
           "vocab_size": c.vocab_size, "max_position_embeddings": 4096, "rope_theta": 10000.0,
           "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
           "tie_word_embeddings": tie}
    (d / "config.json").write_text(json.dumps(cfg))
    weights = dict(model.w)
    if tie:
        weights.pop("lm_head.weight")
    names = sorted(weights)
    half = len(names) // 2                   # two shards, as real checkpoints have
    write_safetensors(d / "model-00001-of-00002.safetensors", {n: weights[n] for n in names[:half]}, dtype)
    write_safetensors(d / "model-00002-of-00002.safetensors", {n: weights[n] for n in names[half:]}, dtype)
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(
        "the quick brown fox jumps over lazy dog".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))


def test_checkpoint_loads_and_matches_the_model_it_was_written_from(engine, tmp_path):
    _write_checkpoint(tmp_path, engine.model)
    loaded = Engine.load(str(tmp_path))
    assert loaded.cfg.geometry == engine.cfg.geometry
    assert loaded.tokenizer.encode("the quick fox") == [1, 3, 4, 6]
    assert loaded.tokenizer.decode([3, 4, 6]) == "the quick fox"
    p = [1, 3, 4, 5, 6, 7, 8, 9, 10] * 3
    assert loaded.generate(p, Sampling(6)) == engine.generate(p, Sampling(6))
    out = subprocess.run([sys.executable, "-m", "tract_cli.cli", "generate", "the lazy dog",
                          "--model", str(tmp_path), "--max-tokens", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["prompt_tokens"] == 4


def test_pool_formatted_from_a_checkpoint_directory_fits_its_engine(engine, tmp_path, region_path):
    from tract_cli.serve.worker import PoolWorker
    d = tmp_path / "my-llama"
    d.mkdir()
    _write_checkpoint(d, engine.model)
    out = subprocess.run([sys.executable, "-m", "tract_cli.cli", "init", region_path, "--size", "16M",
                          "--model", str(d), "-q"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    w = PoolWorker(region_path, 1, Engine.load(str(d)), start_agent=False)
    assert w.pool.info.model_name == "my-llama"
    w.close()


def test_bf16_checkpoint_and_tied_embeddings(engine, tmp_path):
    _write_checkpoint(tmp_path, engine.model, "BF16", tie=True)
    loaded = LlamaModel.from_checkpoint(tmp_path)
    w = loaded.w["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(w, engine.model.w["model.layers.0.self_attn.q_proj.weight"].bfloat16().float())
    assert loaded.lm_head is loaded.w["model.embed_tokens.weight"]


@pytest.mark.parametrize("damage,needle", [
    (lambda b: b[:5], "shorter than"),
    (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "header length"),
    (lambda b: struct.pack("<Q", 4096) + b[8:], "header length exceeds the file"),
    (lambda b: b[:8] + b"]" + b[9:], "not JSON"),
    (lambda b: b[:-4], "do not match"),
])
def test_damaged_safetensors_are_refused(tmp_path, damage, needle):
    f = tmp_path / "w.safetensors"
    write_safetensors(f, {"a": torch.ones(4, 4), "b": torch.zeros(3)})
    f.write_bytes(damage(f.read_bytes()))
    with pytest.raises(UsageError, match=needle):
        read_safetensors(f)


@pytest.mark.parametrize("edit,needle", [
    ({"model_type": "gpt2"}, "not a Llama-family"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"hidden_size": "big"}, "malformed"),
])
def test_bad_configs_are_refused(engine, tmp_path, edit, needle):
    _write_checkpoint(tmp_path, engine.model)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match=needle):
        Engine.load(str(tmp_path))


def test_missing_tensor_and_wrong_shape_are_named(engine, tmp_path):
    _write_checkpoint(tmp_path, engine.model)
    f = tmp_path / "model-00002-of-00002.safetensors"
    w = read_safetensors(f)
    name = sorted(w)[0]
    w[name] = w[name][:1]
    write_safetensors(f, w)
    with pytest.raises(UsageError, match="has shape"):
        LlamaModel.from_checkpoint(tmp_path)
    w.pop(name)
    write_safetensors(f, w)
    with pytest.raises(UsageError, match="lacks tensor"):
        LlamaModel.from_checkpoint(tmp_path)


def test_llama3_rope_scaling_is_applied():
    base = dict(name="t", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32,
                intermediate_size=64, vocab_size=300, max_positions=1024, rope_theta=500000.0)
    from tract_cli.serve.model import _inv_freq
    plain = _inv_freq(ModelConfig(**base))
    scaled = _inv_freq(ModelConfig(**base, rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                                          ("low_freq_factor", 1.0),
                                                          ("original_max_position_embeddings", 8192))))
    assert torch.equal(scaled[0], plain[0])                    # high frequencies kept
    assert torch.allclose(scaled[-1], plain[-1] / 8)           # low frequencies divided by factor


def test_cli_errors_are_one_line(region_path):
    def tract(*args):
        return subprocess.run([sys.executable, "-m", "tract_cli.cli", *args], capture_output=True,
                              text=True, timeout=120)
    out = tract("serve-decode", "--pool", region_path, "--node", "2", "--prefill", "localhost:8100")
    assert out.returncode == 2 and "not an http:// URL" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    Pool.create(region_path, 16 << 20, "tiny").close()
    out = tract("serve-prefill", "--pool", region_path, "--node", "1", "--no-agent", "--port", "0")
    assert out.returncode != 0 and "holds KV blocks of tiny" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = tract("generate", "x", "--model", "/nonexistent")
    assert out.returncode == 2 and "is not a directory" in out.stderr
