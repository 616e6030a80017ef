#!/usr/bin/env python
"""Online serving benchmark for any OpenAI-compatible server: a thin wrapper of `jserve bench`
(the code lives in jserve/bench/). `python scripts/bench_serving.py --help` lists the flags.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --workload mix \\
        --num-requests 64 --concurrency 16 --output-dir bench_out
"""

import sys

from jserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
