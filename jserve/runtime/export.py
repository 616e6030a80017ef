"""The runner's compiled steps exported for an accelerator from any machine (`jax.export`): the
decode, prefill and mixed steps (the ragged kernel), the speculative verify step and the sampler,
with the platform's real kernels, over abstract weights and pages, so nothing of the model's size
is allocated (an 8B model's steps export on a laptop). CI runs it for TPU and CUDA: a change that
breaks accelerator lowering fails the suite (tests/test_export.py); `jserve export` does it by
hand.
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
    steps = _StepExporter.build(config, platform, jnp.dtype(dtype), page_size, num_pages, max_model_len)
    token_buckets = tuple(t for t in token_buckets if t <= max_model_len)
    for B in batch_buckets:
        yield steps.decode(B)
    for T in token_buckets:  # a prefill: one chunk
        yield steps.mixed("prefill", [steps.row(T)], T)
    if token_buckets:  # decode rows and a chunk in one call
        B, T = max(batch_buckets), token_buckets[-1]
        yield steps.mixed("mixed", [steps.row(1)] * (B - 1) + [steps.row(T - B + 1)], T)
    if num_speculative_tokens:
        yield steps.verify(batch_buckets[0], num_speculative_tokens)
    for B in batch_buckets:
        yield steps.sample(B)


@dataclasses.dataclass(frozen=True)
class _StepExporter:
    """What every exported step shares (the platform, the abstract weights and KV pages, the
    model's structure and operations), and the export of each kind of step."""

    config: ModelConfig
    platform: str
    params: Any
    kv: Any
    graphdef: Any
    ops: Any
    page_size: int
    max_model_len: int

    @classmethod
    def build(cls, config: ModelConfig, platform: str, wdtype: Any, page_size: int, num_pages: int,
              max_model_len: int) -> "_StepExporter":
        backend = create_backend(PLATFORMS[platform])
        stacked = {k: jax.ShapeDtypeStruct(s, wdtype) for k, s in param_shapes(config).items()}
        params = jax.eval_shape(functools.partial(backend.prepare_params, config), stacked)
        kv = jax.eval_shape(lambda: backend.init_kv(config, num_pages, page_size, jnp.bfloat16, None))
        return cls(config, platform, params, kv, model_graphdef(config, backend.param_layout),
                   backend.ops(config), page_size, max_model_len)

    @property
    def max_pages(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    def row(self, num_tokens: int, num_drafts: int = 0) -> StepRow:
        """A row of `num_tokens` tokens (then `num_drafts` draft tokens) over a whole context's pages."""
        return StepRow(0, [0] * num_tokens, [0] * self.max_pages, draft_ids=[0] * num_drafts)

    def inputs(self, B: int, T: int, drafts: int = 0):
        """A padded step's packed inputs, greedy sampling rows and an empty penalty history."""
        rows = [self.row(T - drafts, drafts)] * B
        packed = step_rows.pack([dataclasses.replace(r, token_ids=[*r.token_ids, *r.draft_ids]) for r in rows],
                                B, T, max_pages=self.max_pages, page_size=self.page_size)
        sampling = SamplingArrays.build([None] * B, B)
        history = penalty_history([], B, self.max_model_len, self.config.vocab_size)
        return packed, sampling, history

    def run(self, kind: str, bucket: tuple[int, ...], fn, *args) -> tuple[ExportedStep, Any]:
        """Export `fn` at `args`' shapes (the KV pages donated, as the runner does)."""
        exported = jax.export.export(jax.jit(fn, donate_argnames=("kv",) if kind != "sample" else ()),
                                     platforms=(self.platform,))(*_abstract(args))
        targets = re.findall(r"custom_call @(\w+)", exported.mlir_module())
        calls = sum(t == "tpu_custom_call" or t.startswith("mosaic_gpu") for t in targets)
        # The StableHLO bytecode (serialize() wraps it in flatbuffers, a package not needed otherwise).
        return ExportedStep(kind, bucket, len(exported.mlir_module_serialized), calls), exported

    def _forward(self, kind: str, bucket: tuple[int, ...], tokens, positions, meta, last):
        forward = functools.partial(device_steps.forward, self.graphdef, self.ops)
        return self.run(kind, bucket, lambda params, kv, *a: forward(params, kv, *a), self.params, self.kv,
                        tokens, positions, meta, last)

    def decode(self, B: int) -> tuple[ExportedStep, Any]:
        (tokens, positions, meta, last), _, _ = self.inputs(B, 1)
        return self._forward("decode", (B, 1), tokens, positions, meta, last)

    def mixed(self, kind: str, rows: list[StepRow], T: int) -> tuple[ExportedStep, Any]:
        """A mixed step (the ragged kernel) of these rows' tokens in a bucket of T."""
        R = len(rows)
        tokens, positions, meta, last = step_rows.pack_ragged([rows], R, T, max_pages=self.max_pages,
                                                              page_size=self.page_size)
        return self._forward(kind, (R, T), tokens, positions, meta, last)

    def verify(self, B: int, num_drafts: int) -> tuple[ExportedStep, Any]:
        """The speculative verify step of `num_drafts` drafts per row."""
        verify = functools.partial(device_steps.verify, self.graphdef, self.ops)
        T = num_drafts + 1
        (tokens, positions, meta, _), sampling, history = self.inputs(B, T, num_drafts)
        drafts = np.zeros((B, num_drafts), np.int32)
        mask = np.full((B * T, bitmask_width(self.config.vocab_size)), -1, np.int32)
        return self.run("verify", (B, T), lambda params, kv, *a: verify(params, kv, *a), self.params, self.kv,
                        tokens, positions, meta, drafts, sampling, history, mask)

    def sample(self, B: int) -> tuple[ExportedStep, Any]:
        _, sampling, history = self.inputs(B, 1)
        logits = jax.ShapeDtypeStruct((B, self.config.vocab_size), jnp.float32)
        mask = np.full((B, bitmask_width(self.config.vocab_size)), -1, np.int32)
        return self.run("sample", (B,), device_steps.sample_rows, logits, sampling, history, mask)
