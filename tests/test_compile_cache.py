"""The portable compile artifact: `jserve warmup --out DIR` compiles every bucket into DIR with
a manifest of what it was compiled for; `serve --compile-cache DIR` uses it when the key matches
and names the fields that differ otherwise."""

from __future__ import annotations

import json

import pytest

from jserve.engine import compile_cache

SMALL = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)


def test_the_key_names_what_differs(tmp_path, smollm2_checkpoint):
    key = compile_cache.artifact_key(str(smollm2_checkpoint), None, SMALL)
    assert key["engine"]["max_model_len"] == 128 and key["dtype"] == "float32" and key["jax"]
    with pytest.raises(ValueError, match="holds no compile artifact"):
        compile_cache.mismatches(tmp_path, key)
    compile_cache.write_manifest(tmp_path, key)
    assert compile_cache.mismatches(tmp_path, key) == []
    other = compile_cache.artifact_key(str(smollm2_checkpoint), "bfloat16", {**SMALL, "max_num_seqs": 4})
    assert compile_cache.mismatches(tmp_path, other) == ["dtype: 'float32' there, 'bfloat16' here",
                                                         "engine.max_num_seqs: 2 there, 4 here"]
    stored = json.loads((tmp_path / "manifest.json").read_text())
    stored["device_kind"] = "tpu:TPU v5 lite"
    (tmp_path / "manifest.json").write_text(json.dumps(stored))
    assert compile_cache.mismatches(tmp_path, key) == ["device_kind: 'tpu:TPU v5 lite' there, 'cpu:cpu' here"]
    assert compile_cache.resolve(tmp_path, str(smollm2_checkpoint), None, SMALL) is None  # compiles as usual


def test_warmup_defaults_to_the_servers_key(smollm2_checkpoint):
    """`jserve warmup` and `jserve serve` with the same flags (none, or some) key alike: the server's
    defaults (async scheduling, decode steps a call) are warm-up's."""
    from jserve.cli import build_parser
    from jserve.engine.config import engine_kwargs

    parse = build_parser().parse_args
    for flags in ([], ["--max-num-seqs", "4", "--num-scheduler-steps", "1"]):
        serve, warmup = (compile_cache.artifact_key(str(smollm2_checkpoint), None, engine_kwargs(parse(command)))
                         for command in (["serve", *flags], ["warmup", "--out", "x", *flags]))
        assert serve == warmup, flags


def test_warmup_then_serve_from_the_artifact(tmp_path, smollm2_checkpoint):
    """As a user runs them: `jserve warmup` in one process, a server's engine in another, which
    finds every step in the artifact (no new cache entry) and compiles nothing after warm-up."""
    import os
    import subprocess
    import sys

    out = tmp_path / "artifact"
    flags = ["--max-model-len", "128", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
    env = {**os.environ, "JSERVE_COMPILATION_CACHE": str(tmp_path / "own-cache")}
    done = subprocess.run([sys.executable, "-m", "jserve.cli", "warmup", "--model", str(smollm2_checkpoint),
                           "--out", str(out), *flags], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]
    entries = sorted(p.name for p in compile_cache.cache_dir(out).iterdir())
    assert entries and (out / "manifest.json").is_file()
    code = (f"from jserve.cli import build_parser\n"
            f"from jserve.engine import compile_cache\n"
            f"from jserve.engine.config import engine_kwargs\n"
            f"from jserve.llm import LLM\n"  # the server's settings, every bucket compiled before serving
            f"settings = engine_kwargs(build_parser().parse_args(['serve', '--no-lazy-buckets', *{flags!r}]))\n"
            f"cache = compile_cache.resolve({str(out)!r}, {str(smollm2_checkpoint)!r}, None, settings)\n"
            f"assert cache is not None\n"
            f"llm = LLM({str(smollm2_checkpoint)!r}, compilation_cache=cache, **settings)\n"
            f"print(llm.engine.stats()['compilations_after_warmup'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0 and done.stdout.split()[-1] == "0", done.stderr[-2000:]
    assert sorted(p.name for p in compile_cache.cache_dir(out).iterdir()) == entries  # every step was there
