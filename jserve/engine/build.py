"""build_engine: size the page pool, build the runner (and a draft model's), warm up, make the engine.

`resolve_max_model_len` settles the context length against the model's; `build_engine` reads
`EngineConfig` once and turns it into a `Runner` (backend, mesh, page pool from the memory plan,
buckets) and an `LLMEngine` over it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from jserve.engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from jserve.engine.llm_engine import LLMEngine
from jserve.model import quant
from jserve.runtime.runner import Runner
from jserve.text.tokenizer import Tokenizer

DEFAULT_CPU_KV_BYTES = 512 * 2**20
logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, model_config) -> EngineConfig:
    """The config with its context length settled: the model's (at most DEFAULT_MAX_MODEL_LEN)
    when none is given; ValueError naming a length the model cannot take."""
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return dataclasses.replace(config, max_model_len=min(limit, DEFAULT_MAX_MODEL_LEN))
    if not 2 <= config.max_model_len <= limit:
        raise ValueError(f"max_model_len must be an integer in [2, {limit}] (the model's context), "
                         f"got {config.max_model_len!r}")
    return config


def resolve_platform_defaults(config: EngineConfig) -> EngineConfig:
    """The config with the batch settings left unset taken from this device's platform defaults."""
    import jax

    from jserve.runtime.kv_cache import device_memory_bytes

    device = jax.local_devices()[0]  # (another process's devices report no memory)
    return config.with_platform_defaults(device.platform, getattr(device, "device_kind", ""),
                                         device_memory_bytes(device))


def _device_kind() -> str:
    import jax

    device = jax.devices()[0]
    return f"{len(jax.devices())} x {getattr(device, 'device_kind', device.platform)}"


def _lora_spec(config: EngineConfig, source_config, model_config, pooling):
    """The model's LoRA slots with `enable_lora`; ValueError where they cannot be served."""
    if not config.enable_lora:
        return None
    from jserve.model.lora import LoraSpec

    if pooling is not None:
        raise ValueError("LoRA adapters serve generation: give no --enable-lora with task embed")
    import jax

    if jax.process_count() > 1:  # process 0 writes the slots; the others would never see an adapter
        raise ValueError("LoRA adapters are served by one process for now: give no --enable-lora with "
                         "--distributed")
    if model_config != source_config:  # tp padded or replicated heads: an adapter's q/k/v would need it too
        raise ValueError(f"LoRA on this mesh needs every tp shard to hold whole heads ({source_config.num_heads} "
                         f"query and {source_config.num_kv_heads} KV heads): pick a tp that divides both")
    return LoraSpec.for_model(source_config, config.max_loras, config.max_lora_rank,
                              None if config.lora_dtype == "auto" else config.lora_dtype)


def build_engine(model_config, params: dict, tokenizer: Tokenizer, eos_token_ids: Sequence[int],
                 config: EngineConfig, quantization: dict[str, Any] | None = None,
                 draft: tuple[Any, dict] | None = None, pooling: Any = None) -> LLMEngine:
    """Size the page pool, build the runner (warming it up if asked) and the engine.
    `quantization`: the weights' quantization record (with its quality report), for reports.
    `draft`: the draft model's (config, params) for speculative decoding with a draft model; its
    runner gets as many pages as the target's, of the same size (the KV budget covers both).
    `pooling`: the checkpoint's declared `PoolingConfig` (None: none); with task embed (or auto and
    one declared) the engine is an `EmbedEngine`, which pools every prompt token, so with no
    prefix caching."""
    from jserve.core import buckets
    from jserve.engine.embed_engine import resolve_pooling
    from jserve.runtime import backends
    from jserve.runtime.kv_cache import kv_page_dtype

    config = resolve_max_model_len(config, model_config)
    pooling = resolve_pooling(config, pooling)
    if pooling is not None:  # plain prefill steps
        config = dataclasses.replace(config, enable_prefix_caching=False, num_scheduler_steps=1)
    config = resolve_platform_defaults(config)
    source_config = model_config  # what new weights are named and shaped by (update_weights)
    spec = config.speculative_config
    mesh, dp, tp = None, 1, 1
    if config.mesh is not None:
        from jserve.runtime.sharding import make_mesh, mesh_sizes

        mesh = make_mesh(config.mesh)
        dp, tp = mesh_sizes(mesh)["dp"], mesh_sizes(mesh)["tp"]
    config.scheduler_config(dp)  # validates the scheduling knobs early, naming the bad value
    weight_dtype = quant.float_dtype(params)
    kv_dtype = weight_dtype if config.kv_cache_dtype == "auto" else kv_page_dtype(config.kv_cache_dtype)
    backend = backends.create(config.backend, mesh=mesh, batch_invariant=config.batch_invariant,
                              int8_activations=config.int8_activations)  # resolved here, once
    page_size = config.page_size if config.page_size is not None else backend.default_page_size
    num_pages = config.num_pages
    if num_pages is None:
        num_pages = _planned_pages(config, model_config, params, draft, page_size=page_size, kv_dtype=kv_dtype,
                                   mesh=mesh, dp=dp, tp=tp)
    if mesh is not None:
        from jserve.runtime.sharding import place_params

        # Pad/replicate heads for tp and put every weight in its sharding (jserve.runtime.sharding).
        model_config, params = place_params(model_config, params, mesh, layout=backend.param_layout)
        num_pages -= num_pages % dp
    num_pages, local_pages = _hybrid_pages(config, model_config, num_pages, page_size=page_size, dp=dp,
                                           draft=spec is not None and spec.method == "draft_model", pooling=pooling)
    lora = _lora_spec(config, source_config, model_config, pooling)
    seqs = config.max_num_seqs // dp
    batch_buckets = buckets.decode_buckets(seqs)
    runner = Runner(model_config, params, num_pages=num_pages, page_size=page_size,
                    max_model_len=config.max_model_len, kv_dtype=kv_dtype, backend=backend,
                    batch_buckets=batch_buckets, max_num_batched_tokens=config.max_num_batched_tokens // dp,
                    token_buckets=buckets.FINE_TOKEN_BUCKETS if config.lazy_buckets else buckets.DEFAULT_TOKEN_BUCKETS,
                    mesh=mesh, max_decode_steps=config.num_scheduler_steps,
                    num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
                    max_verify_rows=spec.disable_by_batch_size or backend.speculative_batch_limit if spec else None,
                    lora=lora, local_pages=local_pages)
    if config.kv_offload_bytes is not None and pooling is None:
        runner.kv_transfer = _kv_transfer(runner, config.kv_offload_bytes, config.kv_offload_dir)
    logger.info("engine: backend %s (%s kernel) on %s; max_num_seqs %d, max_num_batched_tokens %d; %d KV pages "
                "of %d tokens (%d tokens, %s); decode batch buckets %s", backend.name, backend.kernel,
                _device_kind(), config.max_num_seqs, config.max_num_batched_tokens, num_pages,
                page_size, num_pages * page_size, kv_dtype.name, list(runner.batch_buckets))
    if pooling is not None:
        return _embed_engine(runner, tokenizer, config, pooling, quantization)
    draft_runner = None
    if spec is not None and spec.method == "draft_model":
        draft_runner = _draft_runner(config, model_config, draft, num_pages=num_pages, page_size=page_size,
                                     kv_dtype=kv_dtype, batch_buckets=batch_buckets)
    if runner.multiprocess:
        import jax

        if config.warmup and jax.process_index() == 0:
            runner.warmup()  # the other processes compile the same shapes in Runner.follow()
        engine = LLMEngine(runner, tokenizer, eos_token_ids, config, quantization)
    else:
        if config.warmup:
            runner.warmup(lazy=config.lazy_buckets)
        engine = LLMEngine(runner, tokenizer, eos_token_ids, config, quantization, draft_runner)
    engine.source_config = source_config
    return engine


def _kv_transfer(runner: Runner, offload_bytes: int, directory: str | None):
    """The host KV tier's copies over the runner's pages (`jserve.runtime.kv_transfer`), its pool in
    host memory or, with `directory`, in a memory-mapped file there."""
    from jserve.runtime.kv_transfer import KVTransfer

    if runner.multiprocess:
        raise ValueError("kv_offload_bytes: the host KV tier runs in one process for now: give no --distributed")
    transfer = KVTransfer(runner, offload_bytes, directory)
    logger.info("engine: %s KV tier of %d pages per dp group (%.1f MiB), %d pages copied out at once",
                f"disk ({directory})" if directory else "host", transfer.slots_per_group,
                transfer.slots_per_group * runner.dp * transfer.page_bytes / 2**20, transfer.staging_pages)
    return transfer


def _embed_engine(runner: Runner, tokenizer: Tokenizer, config: EngineConfig, pooling, quantization):
    """The embedding engine over `runner`, its pooled step compiled first (every shape)."""
    from jserve.engine.embed_engine import EmbedEngine

    logger.info("engine: task embed, %s pooling%s", pooling.pooling, ", normalised" if pooling.normalize else "")
    engine = EmbedEngine(runner, tokenizer, config, pooling, quantization)
    if config.warmup:
        engine.pooled.warmup()
    return engine


def _hybrid_pages(config: EngineConfig, model_config, num_pages: int, *, page_size: int, dp: int, draft: bool,
                  pooling: Any) -> tuple[int, int | None]:
    """`(num_pages, local_pages)`: the pool split between the full and the sliding layers
    (`jserve.core.hybrid_pages.split_pages`, per dp group) where hybrid pages apply, else
    `(num_pages, None)`."""
    from jserve.core.hybrid_pages import split_pages

    c = model_config
    if not (config.hybrid_pages and c.mixed_layers):
        return num_pages, None
    off = ("a host KV tier" if config.kv_offload_bytes is not None else "a draft model" if draft else
           "embeddings" if pooling is not None else None)
    if off is not None:
        logger.info("hybrid pages off: %s keeps one pool for every layer", off)
        return num_pages, None
    sliding = sum(c.layer_is_sliding(i) for i in range(c.num_layers))
    split = split_pages(num_pages // dp, num_layers=c.num_layers, sliding_layers=sliding, page_size=page_size,
                        context=config.max_model_len, window=c.sliding_window,
                        max_chunk=config.max_num_batched_tokens // dp)
    if split is None:
        logger.info("hybrid pages off: a window of %d holds as many pages as a context of %d, or the pool is short",
                    c.sliding_window, config.max_model_len)
        return num_pages, None
    logger.info("hybrid pages: %d pages for each of %d full layers, %d for each of %d sliding layers (per dp "
                "group; %d with one pool)", split[0], c.num_layers - sliding, split[1], sliding, num_pages // dp)
    return split[0] * dp, split[1] * dp


def _planned_pages(config: EngineConfig, model_config, params: dict, draft, *, page_size: int, kv_dtype,
                   mesh, dp: int, tp: int) -> int:
    """The page pool from the memory plan: the KV budget (explicit, or the device's memory) is
    per device, and each dp group has its own; a draft model's weights and pages share it."""
    from jserve.runtime.kv_cache import device_memory_bytes, plan_memory
    from jserve.runtime.sharding import device_share, params_per_device

    weight_dtype = quant.float_dtype(params)
    plan_config = model_config if mesh is None else device_share(model_config, tp)  # one device's share
    device = None if config.kv_cache_bytes is not None else device_memory_bytes()
    budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else (
        None if device is not None else DEFAULT_CPU_KV_BYTES)
    weight_bytes = quant.param_bytes(params) if mesh is None else (
        params_per_device(model_config, tp) * weight_dtype.itemsize)
    if draft is not None:
        weight_bytes += quant.param_bytes(draft[1])  # the draft model's weights share the device
    plan = plan_memory(plan_config, weight_dtype_bytes=weight_dtype.itemsize, kv_dtype=kv_dtype.name,
                       page_size=page_size, context=config.max_model_len, device_bytes=device,
                       memory_fraction=config.memory_fraction, kv_budget_bytes=budget,
                       max_num_batched_tokens=config.max_num_batched_tokens, weight_bytes=weight_bytes)
    if plan.num_pages * page_size < config.max_model_len:
        raise ValueError(f"the KV pages that fit ({plan.num_pages} of {page_size} tokens per dp group: "
                         f"{plan.num_pages * page_size} tokens) do not hold one context of --max-model-len "
                         f"{config.max_model_len}: lower --max-model-len, raise --memory-fraction (now "
                         f"{config.memory_fraction:g}) or --kv-cache-bytes, shrink the pages with --kv-cache-dtype "
                         "bfloat16 / int8 / fp8, or shard over more devices (--mesh tp=N, -tp N)")
    num_pages = plan.num_pages * dp
    if draft is not None:  # the same number of pages again, in the draft model's KV layout
        target_page, draft_page = (c.kv_bytes_per_token(kv_dtype.itemsize) for c in (plan_config, draft[0]))
        num_pages = max(2, num_pages * target_page // (target_page + draft_page))
    return num_pages


def _draft_runner(config: EngineConfig, model_config, draft, *, num_pages: int, page_size: int, kv_dtype,
                  batch_buckets) -> Runner:
    """The draft model's runner: its pages mirror the target's (count and size)."""
    from jserve.runtime import backends

    if draft is None:
        raise ValueError("speculative_config method 'draft_model': the draft model was not loaded")
    draft_config, draft_params = draft
    if draft_config.max_position_embeddings < config.max_model_len:
        raise ValueError(f"the draft model's context ({draft_config.max_position_embeddings}) is shorter than "
                         f"max_model_len ({config.max_model_len}): give a shorter max_model_len or another draft")
    if draft_config.vocab_size != model_config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft_config.vocab_size}) differs from the "
                         f"target's ({model_config.vocab_size}): a draft needs the same tokenizer")
    # A backend of its own: a backend keeps what it learnt preparing its model's weights.
    runner = Runner(draft_config, draft_params, num_pages=num_pages, page_size=page_size,
                    max_model_len=config.max_model_len, kv_dtype=kv_dtype, backend=backends.create(config.backend),
                    batch_buckets=batch_buckets, max_num_batched_tokens=config.max_num_batched_tokens,
                    max_decode_steps=config.speculative_config.num_speculative_tokens + 1)
    if config.warmup:
        runner.warmup()
    return runner
