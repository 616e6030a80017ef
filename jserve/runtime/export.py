"""The runner's compiled steps exported for an accelerator from any machine (`jax.export`): the
decode, prefill and mixed steps (the ragged kernel), the speculative verify step and the sampler,
with the platform's real kernels, over abstract weights and pages, so nothing of the model's size
is allocated (an 8B model's steps export on a laptop). CI runs it for TPU and CUDA: a change that
breaks accelerator lowering fails the suite (tests/test_export.py); `scripts/export_steps.py`
does it by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jserve.model import model_graphdef
from jserve.model.config import ModelConfig
from jserve.model.llama import param_shapes
from jserve.runtime import device_steps, step_rows
from jserve.runtime.backends import create as create_backend
from jserve.runtime.sampler import SamplingArrays, penalty_history
from jserve.runtime.steps import StepRow
from jserve.structured.grammar import bitmask_width

PLATFORMS = {"tpu": "tpu", "cuda": "gpu"}  # jax.export platform -> the XLA backend's kernel


@dataclasses.dataclass(frozen=True)
class ExportedStep:
    kind: str  # "decode" | "prefill" (a mixed step of one chunk) | "mixed" | "verify" | "sample"
    bucket: tuple[int, ...]  # (batch, tokens), or (rows,) for the sampler
    serialized_bytes: int
    kernel_calls: int  # the Mosaic kernels' custom calls in the module (the scanned stack calls one)


def _abstract(x: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype if not hasattr(a, "dtype")
                                                       else a.dtype), x)


def export_steps(config: ModelConfig, platform: str, *, dtype: str = "bfloat16", page_size: int = 16,
                 num_pages: int = 1024, max_model_len: int = 4096,
                 batch_buckets: tuple[int, ...] = (8, 64), token_buckets: tuple[int, ...] = (128, 512),
                 num_speculative_tokens: int = 4) -> Iterator[tuple[ExportedStep, Any]]:
    """Export each step shape for `platform` ("tpu" or "cuda"); yields (what, the `jax.export.Exported`).
    The weights are `dtype` and the KV pages bfloat16 (what the GPU kernel takes)."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {tuple(PLATFORMS)}, got {platform!r}")
    backend = create_backend(PLATFORMS[platform])
    wdtype = jnp.dtype(dtype)
    stacked = {k: jax.ShapeDtypeStruct(s, wdtype) for k, s in param_shapes(config).items()}
    params = jax.eval_shape(functools.partial(backend.prepare_params, config), stacked)
    kv = jax.eval_shape(lambda: backend.init_kv(config, num_pages, page_size, jnp.bfloat16, None))
    ops = backend.ops(config)
    graphdef = model_graphdef(config, backend.param_layout)
    max_pages = math.ceil(max_model_len / page_size)
    token_buckets = tuple(t for t in token_buckets if t <= max_model_len)

    def inputs(B: int, T: int, drafts: int = 0):
        rows = [StepRow(0, [0] * (T - drafts), [0] * max_pages, draft_ids=[0] * drafts)] * B
        packed = step_rows.pack([dataclasses.replace(r, token_ids=[*r.token_ids, *r.draft_ids]) for r in rows],
                                B, T, max_pages=max_pages, page_size=page_size)
        sampling = SamplingArrays.build([None] * B, B)
        history = penalty_history([], B, max_model_len, config.vocab_size)
        return packed, sampling, history

    def run(kind, bucket, fn, *args):
        exported = jax.export.export(jax.jit(fn, donate_argnames=("kv",) if kind != "sample" else ()),
                                     platforms=(platform,))(*_abstract(args))
        targets = re.findall(r"custom_call @(\w+)", exported.mlir_module())
        calls = sum(t == "tpu_custom_call" or t.startswith("mosaic_gpu") for t in targets)
        # The StableHLO bytecode (serialize() wraps it in flatbuffers, a package not needed otherwise).
        return ExportedStep(kind, bucket, len(exported.mlir_module_serialized), calls), exported

    forward = functools.partial(device_steps.forward, graphdef, ops)
    for B in batch_buckets:
        (tokens, positions, meta, last), _, _ = inputs(B, 1)
        yield run("decode", (B, 1), lambda params, kv, *a: forward(params, kv, *a), params, kv, tokens, positions,
                  meta, last)
    def mixed(kind, rows):  # a mixed step (the ragged kernel) of these rows' tokens in a bucket of T
        R, T = len(rows), token_buckets[-1] if kind == "mixed" else sum(r.num_tokens for r in rows)
        tokens, positions, meta, last = step_rows.pack_ragged([rows], R, T, max_pages=max_pages, page_size=page_size)
        return run(kind, (R, T), lambda params, kv, *a: forward(params, kv, *a), params, kv, tokens, positions,
                   meta, last)

    for T in token_buckets:  # a prefill: one chunk
        yield mixed("prefill", [StepRow(0, [0] * T, [0] * max_pages)])
    if token_buckets:  # decode rows and a chunk in one call
        B, T = max(batch_buckets), token_buckets[-1]
        yield mixed("mixed", [StepRow(0, [0], [0] * max_pages)] * (B - 1) + [StepRow(0, [0] * (T - B + 1),
                                                                                     [0] * max_pages)])
    if num_speculative_tokens:
        verify = functools.partial(device_steps.verify, graphdef, ops)
        T = num_speculative_tokens + 1
        B = batch_buckets[0]
        (tokens, positions, meta, _), sampling, history = inputs(B, T, num_speculative_tokens)
        drafts = np.zeros((B, num_speculative_tokens), np.int32)
        mask = np.full((B * T, bitmask_width(config.vocab_size)), -1, np.int32)
        yield run("verify", (B, T), lambda params, kv, *a: verify(params, kv, *a), params, kv, tokens, positions,
                  meta, drafts, sampling, history, mask)
    for B in batch_buckets:
        _, sampling, history = inputs(B, 1)
        logits = jax.ShapeDtypeStruct((B, config.vocab_size), jnp.float32)
        mask = np.full((B, bitmask_width(config.vocab_size)), -1, np.int32)
        yield run("sample", (B,), device_steps.sample_rows, logits, sampling, history, mask)
