"""`jserve plan`: how a model's weights, activations and KV pages fit in a device's memory, printed
as a table (the engine's own memory plan, `jserve.runtime.kv_cache.plan_memory`)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from jserve.engine.config import engine_kwargs


def human(n: float) -> str:
    """Bytes in the largest binary unit under 1024 of it: '512 B', '1.50 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


@dataclasses.dataclass
class _Weights:
    """What one device holds of the weights, for the plan."""

    plan_config: Any  # the model config whose KV heads one device holds
    weight_bytes: int | None  # None: the float weights' own count
    label: str
    per_device: str = ""  # " per device" on a mesh
    dp: int = 1


def run_plan(args: argparse.Namespace) -> int:
    from jserve.engine.build import resolve_max_model_len, resolve_platform_defaults
    from jserve.engine.config import EngineConfig
    from jserve.model.checkpoint import read_model_config
    from jserve.runtime.backends import NativeCpuBackend, XlaBackend, canonical_name
    from jserve.runtime.kv_cache import device_memory_bytes, dtype_bytes, plan_memory

    config, weight_dtype = read_model_config(args.model)
    weight_dtype = args.weight_dtype or weight_dtype
    settings = resolve_max_model_len(EngineConfig.from_settings(**engine_kwargs(args)), config)
    settings = resolve_platform_defaults(settings)
    kv_dtype = weight_dtype if settings.kv_cache_dtype == "auto" else settings.kv_cache_dtype
    native = settings.backend is not None and canonical_name(settings.backend) == "native"
    page_size = settings.page_size or (NativeCpuBackend if native else XlaBackend).default_page_size
    device = args.device_memory
    if device is None and settings.kv_cache_bytes is None:
        device = device_memory_bytes()
        if device is None:
            raise ValueError("this device reports no memory size: give --device-memory or --kv-budget")
    weights = _weights(args.model, config, settings, weight_dtype)
    plan = plan_memory(weights.plan_config, weight_dtype_bytes=dtype_bytes(weight_dtype), kv_dtype=kv_dtype,
                       page_size=page_size, context=settings.max_model_len, device_bytes=device,
                       memory_fraction=settings.memory_fraction, kv_budget_bytes=settings.kv_cache_bytes,
                       max_num_batched_tokens=settings.max_num_batched_tokens, weight_bytes=weights.weight_bytes)
    rows = _model_rows(config, settings, weight_dtype, weights.per_device) + _memory_rows(
        plan, settings, weights, kv_dtype) + _concurrency_rows(config, plan, settings, weights, kv_dtype, args)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _weights(model: str | None, config, settings, weight_dtype: str) -> _Weights:
    """The weights' bytes per device: quantized (a stored record, or --quantization's estimate),
    or split over --mesh."""
    from jserve.model.checkpoint import read_quantization
    from jserve.runtime.kv_cache import dtype_bytes

    weights = _Weights(config, None, weight_dtype)
    record = read_quantization(model)
    if record is not None or settings.quantization in ("int8", "int4", "fp8"):
        from jserve.model import quant
        from jserve.model.llama import param_shapes

        if settings.mesh is not None:
            raise ValueError("jserve plan: quantized weights on a mesh are not supported yet")
        if record is not None:
            weights.weight_bytes, weights.label = int(record["bits_per_weight"] * config.num_params() / 8), \
                record["label"]
        else:
            spec = quant.QuantSpec.parse(settings.quantization, settings.quantization_group_size)
            weights.weight_bytes = quant.estimate_bytes(param_shapes(config), spec, dtype_bytes(weight_dtype),
                                                        tied=config.tie_word_embeddings)
            weights.label = spec.label()
    if settings.mesh is not None:
        from jserve.runtime.sharding import check_experts, device_share, params_per_device, parse_mesh

        sizes = parse_mesh(settings.mesh)
        tp, ep = sizes["tp"], sizes.get("ep", 1)
        check_experts(config, sizes)
        weights.plan_config = device_share(config, tp, ep)  # one device's KV heads
        weights.weight_bytes = params_per_device(config, tp, ep) * dtype_bytes(weight_dtype)
        weights.per_device, weights.dp = " per device", sizes["dp"]
    return weights


def _model_rows(config, settings, weight_dtype: str, per_device: str) -> list[tuple[str, str]]:
    rows = [("model", f"{config.architecture}, {config.num_layers} layers, {config.num_params() / 1e9:.3f} B params")]
    if settings.mesh is not None:
        from jserve.runtime.sharding import describe

        rows.append(("mesh", describe(config, settings.mesh)))
    if config.moe:  # the routed experts' bytes (all layers), and what one token reads of them
        from jserve.model.moe import EXPERT_WEIGHTS
        from jserve.runtime.kv_cache import dtype_bytes
        from jserve.runtime.sharding import param_bytes_per_device, parse_mesh

        sizes = parse_mesh(settings.mesh) if settings.mesh is not None else {"tp": 1}
        held = param_bytes_per_device(config, sizes["tp"], sizes.get("ep", 1), itemsize=dtype_bytes(weight_dtype))
        label = f"experts ({config.num_experts} x {config.moe_intermediate_size}, top-{config.num_experts_per_tok})"
        rows.append((label + per_device, human(sum(held[n] for n in EXPERT_WEIGHTS))))
    return rows


def _memory_rows(plan, settings, weights: _Weights, kv_dtype: str) -> list[tuple[str, str]]:
    per_device, dp, mesh = weights.per_device, weights.dp, settings.mesh is not None
    return [
        ("device memory", human(plan.device_bytes)),
        (f"usable ({settings.memory_fraction:g})" if settings.kv_cache_bytes is None else "usable",
         human(plan.usable_bytes)),
        (f"weights ({weights.label}){per_device}", human(plan.weight_bytes)),
        (f"activations ({settings.max_num_batched_tokens} tokens)", human(plan.activation_bytes)),
        (f"KV per token ({kv_dtype}){per_device}", human(plan.kv_bytes_per_token)),
        (f"KV per page ({plan.page_size} tokens){per_device}", human(plan.kv_bytes_per_page)),
        (f"KV pages{per_device}", f"{plan.num_pages} ({human(plan.kv_bytes)})"),
        ("tokens in cache" + (f" per dp group (x{dp})" if mesh else ""), f"{(plan.num_pages - 1) * plan.page_size}"),
        (f"sequences of {plan.context} tokens" + (f" (all {dp} dp groups)" if mesh else ""),
         f"{plan.max_sequences * dp}"),
    ]


def add_offload_arg(parser: argparse.ArgumentParser) -> None:
    """`--kv-offload-bytes` for the plan alone where this build has no host KV tier setting
    (where it has one, `add_engine_args` made the flag)."""
    from jserve.engine.config import EngineConfig, parse_bytes

    if "kv_offload_bytes" not in EngineConfig.__dataclass_fields__:
        parser.add_argument("--kv-offload-bytes", dest="kv_offload_bytes", type=parse_bytes, default=None,
                            help="count a host KV tier of this many bytes (in all) in the plan, e.g. 8GiB")


def _concurrency_rows(config, plan, settings, weights: _Weights, kv_dtype: str,
                      args: argparse.Namespace) -> list[tuple[str, str]]:
    """Sequences that fit by page-keeping rule (`jserve.runtime.kv_concurrency`), over all dp groups."""
    from jserve.engine.config import EngineConfig
    from jserve.runtime.kv_cache import dtype_bytes, scale_bytes
    from jserve.runtime.kv_concurrency import concurrency

    dp, context = weights.dp, plan.context
    offload = getattr(args, "kv_offload_bytes", None) or 0
    host_page = config.kv_bytes_per_token(dtype_bytes(kv_dtype), scale_bytes(kv_dtype)) * plan.page_size
    c = concurrency(config, context=context, page_size=plan.page_size, num_pages=plan.num_pages,
                    max_num_batched_tokens=settings.max_num_batched_tokens, host_bytes=offload // dp,
                    host_page_bytes=host_page)
    rows = []
    if c.shared_window:
        rows.append((f"sequences of {context} tokens, pages behind the window ({c.window}) given back",
                     f"{c.window_rule * dp} ({c.window_pages} pages each, {c.full_pages} with every page)"))
        rows.append((f"cached prefixes of {context} tokens kept hittable",
                     f"{c.prefixes_kept() * dp} (a hit needs its last {c.hit_pages} pages; "
                     f"{c.prefixes_kept(window_rule=False) * dp} if it needed every page)"))
    elif c.sliding_layers:
        hybrid = c.hybrid(settings.max_num_batched_tokens)
        built = (f"{hybrid[0] * dp} ({hybrid[1]} pages for each full layer, {hybrid[2]} for each sliding one; "
                 f"{c.every_page * dp} with one pool; --no-hybrid-pages)" if hybrid else
                 f"{c.every_page * dp} (one pool: the window holds the context)")
        rows.append((f"sequences of {context} tokens, hybrid pages ({c.sliding_layers} of {c.num_layers} "
                     f"layers keep a window of {c.window})", built))
    if offload:
        built = "kv_offload_bytes" in EngineConfig.__dataclass_fields__
        rows.append((f"cached prefixes of {context} tokens kept, host tier of {human(offload)}",
                     f"{c.prefixes_kept(host=True) * dp} ({c.host_pages * dp} host pages of {human(host_page)}; "
                     f"running sequences unchanged{'' if built else '; the tier itself is another change'})"))
    return rows
