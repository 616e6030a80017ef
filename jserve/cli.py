"""Command line: `jserve convert | generate`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence


def _convert(args: argparse.Namespace) -> int:
    from jserve.checkpoint import convert

    out = convert(args.source, args.out, dtype=args.dtype, progress=not args.quiet)
    print(out)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from jserve.llm import LLM
    from jserve.request import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                            stop=args.stop or None, ignore_eos=args.ignore_eos)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    completion = out.outputs[0]
    if args.json:
        print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "token_ids": completion.token_ids,
                          "text": completion.text, "finish_reason": completion.finish_reason},
                         ensure_ascii=False))
    else:
        print(completion.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jserve", description="LLM serving engine on JAX")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert a GGUF file or Hugging Face folder to an Orbax checkpoint")
    p.add_argument("source", help="a .gguf file or a folder with config.json and *.safetensors")
    p.add_argument("--out", help="output folder (default: checkpoints/<name>)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_convert)

    p = sub.add_parser("generate", help="generate a continuation of a prompt")
    p.add_argument("--model", default=None, help="checkpoint folder, HF folder, .gguf or name "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weight dtype if the model must be converted first")
    p.add_argument("--json", action="store_true", help="print prompt_token_ids, token_ids and text as JSON")
    p.set_defaults(func=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
