"""vLLM's command line on `jserve serve`: its flags as aliases of jserve's, or as logged no-ops.

A `vllm serve MODEL ...` line runs unchanged as `jserve serve MODEL ...`. Three kinds of flag:
aliases of an engine setting (`--gpu-memory-utilization` is `--memory-fraction`), the parallel
sizes (`-tp`, `-dp`, `--enable-expert-parallel`), which become `--mesh`, and flags whose effect
jserve always has or never needs, which are accepted and logged once (`NO_OPS`). A value jserve
cannot honour (`-pp 2`) is an error naming it, never ignored.
"""

from __future__ import annotations

import argparse
import logging

from jserve.engine.config import parse_bytes
from jserve.model.sampling_defaults import resolve

logger = logging.getLogger("jserve")

# flag -> why it changes nothing here (logged once when given)
NO_OPS = {
    "--enable-chunked-prefill": "jserve always chunks prefills (max_num_batched_tokens per step)",
    "--trust-remote-code": "jserve runs no model code from a checkpoint: its families are built in",
    "--enable-auto-tool-choice": "tool_choice 'auto' is on wherever a tool-call parser applies "
                                 "(--tool-call-parser, or the chat template's)",
    "--disable-log-requests": "requests are logged only with --enable-log-requests",
    "--enforce-eager": "jserve compiles every step (no CUDA graphs to turn off)",
    "--swap-space": "preempted requests are recomputed, not swapped to host memory",
    "--distributed-executor-backend": "jserve runs one process per host through jax.distributed",
    "--disable-frontend-multiprocessing": "the server and the engine share one process",
    "--uvicorn-log-level": "the HTTP server logs at --log-level",
    "--fully-sharded-loras": "jserve shards the LoRA slots as vLLM does without it (B of column-parallel targets, "
                             "A of row-parallel ones, like their base linears)",
    "--max-lora-extra-vocab-size": "jserve reads no added vocabulary from an adapter (one that adds tokens is "
                                   "refused when it loads)",
    "--lora-extra-vocab-size": "jserve reads no added vocabulary from an adapter (one that adds tokens is refused "
                               "when it loads)",
}
_VALUED_NO_OPS = {"--swap-space", "--distributed-executor-backend", "--uvicorn-log-level",
                  "--max-lora-extra-vocab-size", "--lora-extra-vocab-size"}


class _NoOp(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        getattr(namespace, "vllm_no_ops").append(self.option_strings[0])


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags that have no jserve spelling of their own (after `add_engine_args`)."""
    g = p.add_argument_group("vLLM's flags (aliases: the jserve setting they set; no-ops: logged once)")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="devices a layer's weights and heads are split over: --mesh tp=N")
    g.add_argument("-dp", "--data-parallel-size", type=int, default=None, metavar="N",
                   help="engine replicas over the devices, each with its own batch: --mesh dp=N")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=None, metavar="N",
                   help="only 1: jserve splits a model over devices with -tp, not by stages")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE experts split over the -tp devices (--mesh ep=N) instead of each expert")
    g.add_argument("--gpu-memory-utilization", dest="memory_fraction", type=float, default=argparse.SUPPRESS,
                   help="the same as --memory-fraction")
    g.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", dest="kv_cache_bytes", type=parse_bytes,
                   default=argparse.SUPPRESS, help="the same as --kv-cache-bytes")
    g.add_argument("--block-size", dest="page_size", type=int, default=argparse.SUPPRESS,
                   help="the same as --page-size")
    g.add_argument("--long-lora-scaling-factors", default=None, metavar="FACTORS",
                   help="refused: jserve has no long-context LoRA (LongLoRA) scaling")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for fields a request leaves out: 'auto' the model's "
                        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens), 'vllm' the API's own, or a folder's generation_config.json")
    p.set_defaults(vllm_no_ops=[])
    for flag, why in NO_OPS.items():
        g.add_argument(flag, action=_NoOp, nargs=1 if flag in _VALUED_NO_OPS else 0, default=argparse.SUPPRESS,
                       help=f"accepted, no effect: {why}")


def apply_vllm_args(args: argparse.Namespace) -> None:
    """Fold the parallel sizes into `args.mesh` and log the no-ops given; ValueError naming a
    value jserve cannot honour."""
    if not hasattr(args, "tensor_parallel_size"):
        return
    if args.pipeline_parallel_size not in (None, 1):
        raise ValueError(f"--pipeline-parallel-size {args.pipeline_parallel_size}: jserve has no pipeline "
                         "parallelism; split the model with -tp (or --mesh tp=N) instead")
    if args.long_lora_scaling_factors is not None:
        raise ValueError(f"--long-lora-scaling-factors {args.long_lora_scaling_factors}: jserve has no long-context "
                         "LoRA (LongLoRA) scaling; leave it out")
    if args.generation_config not in (None, "auto", "vllm"):
        resolve(args.generation_config, {})  # a bad folder or file is named before the model loads
    sizes = {"dp": args.data_parallel_size, "tp": args.tensor_parallel_size}
    for axis, size in sizes.items():
        if size is not None and size < 1:
            raise ValueError(f"the {axis} size must be >= 1, got {size}")
    if args.enable_expert_parallel:
        sizes["ep"], sizes["tp"] = sizes["tp"] or 1, None
    sizes = {axis: size for axis, size in sizes.items() if size is not None}
    if sizes and getattr(args, "mesh", None) is not None:
        raise ValueError(f"give --mesh or -tp / -dp / --enable-expert-parallel, not both (--mesh {args.mesh})")
    if any(size > 1 for size in sizes.values()):
        args.mesh = ",".join(f"{axis}={size}" for axis, size in sizes.items())
        logger.info("vLLM's parallel sizes: --mesh %s", args.mesh)
    for flag in dict.fromkeys(args.vllm_no_ops):
        logger.info("%s: accepted, no effect: %s", flag, NO_OPS[flag])
