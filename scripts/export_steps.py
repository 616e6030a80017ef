#!/usr/bin/env python3
"""Export the engine's compiled steps for TPU or CUDA from this machine (`jax.export`, the real
Mosaic kernels, abstract weights: nothing of the model's size is allocated, so an 8B config
exports on a laptop). One line per step (kind, bucket, serialized StableHLO bytes, Mosaic kernel
calls), then `exported N steps for PLATFORM`; exit 1 if any step fails to export.

    python scripts/export_steps.py --platform tpu
    python scripts/export_steps.py --platform cuda --model tests/data/configs/llama-3.1-8b.json --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = p.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
