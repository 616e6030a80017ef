"""llguidance vs xgrammar for structured outputs, measured on SmolLM2's tokenizer.

Over the schemas of tests/structured_schemas.py, for each library that imports:
  - import time and tokenizer set-up (from tokenizer.json's text: llguidance's `LLTokenizer`;
    xgrammar's `TokenizerInfo` from the vocabulary in id order plus a `GrammarCompiler`);
  - grammar compile time per schema (llguidance: `grammar_from_json_schema` + `LLMatcher`; xgrammar:
    `compile_json_schema` with its cache off + `GrammarMatcher`), median and max over schemas, and
    the first mask after it (with the compile, what a new request waits for before its first token);
  - the per-token mask along random valid walks (every step a uniform pick among the allowed tokens,
    EOS as soon as it is allowed; each bounded schema walked document after document until `--tokens`
    steps): batch 1 (one `fill_next_token_bitmask` per step), and `--batch` matchers (one bounded schema
    each, round robin) filled together (llguidance: `LLExecutor` + `fill_next_token_bitmask_par`;
    xgrammar: `BatchGrammarMatcher.batch_fill_next_token_bitmask`) and, for contrast, in a loop;
    median, p99 and max per step, plus the time to consume the sampled token;
  - every finished walk checked with `structured_schemas.validate` (json + jsonschema with formats):
    a library whose masks let through a document the schema forbids shows it here;
  - the installed footprint: the library's own files and those of everything it requires.

Both libraries compile compact JSON (", " and ": " separators, no free whitespace), as the engine
does. The SmolLM2 vocabulary's special tokens (<|im_start|> ...) are plain strings to xgrammar's
`TokenizerInfo` (from_huggingface too: it detects none), so they would be allowed inside JSON strings;
they are passed as "" here, which makes xgrammar treat them as special, as llguidance does by itself.

xgrammar needs torch, transformers and triton (see KNOWN_FOOTPRINT), so keep it out of the project's
venv; the script runs with llguidance alone and measures xgrammar when it imports:

    python scripts/bench_grammar_libs.py [--tokens 100] [--batch 16] [--threads 2] [--out bench_grammar_libs.json]
    python3 -m venv /tmp/xg_venv   # then pin a CPU torch build, or pip pulls CUDA torch (~3 GB of wheels):
    /tmp/xg_venv/bin/pip install xgrammar "torch==2.13.0+cpu" llguidance numpy tokenizers jsonschema jinja2
    /tmp/xg_venv/bin/python scripts/bench_grammar_libs.py
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np

from jserve.text.tokenizer import Tokenizer
from structured_schemas import SCHEMAS, validate

SEPARATORS = (", ", ": ")

# What `pip download xgrammar --no-deps` and an install into a separate venv showed (xgrammar 0.2.9,
# CPython 3.11 and 3.13, Linux x86_64): the wheel is 1.3 MB, but it requires apache-tvm-ffi, pydantic,
# torch>=1.10, transformers>=4.38, triton (Linux x86_64), numpy and typing-extensions. Plain
# `pip install xgrammar` resolves torch 2.14.1 from PyPI with its CUDA 13 wheels (~3.0 GB of wheels:
# torch 555 MB, nvidia-cudnn 553 MB, cublas 423 MB, triton 248 MB, nccl 216 MB, cufft 214 MB, ...).
# With torch pinned to a CPU build (2.13.0+cpu, a 192 MB wheel) the venv is 2.2 GB installed: triton
# 1.0 GB, torch 0.77 GB, transformers 0.13 GB, xgrammar itself 4 MB. Importing xgrammar imports torch
# and transformers (~1.7 s). llguidance 1.9.1: one 3.1 MB abi3 wheel (7.8 MB installed), no
# dependencies; its numpy helpers need numpy.
KNOWN_FOOTPRINT = {
    "xgrammar": {
        "version": "0.2.9",
        "wheel_mb": 1.3,
        "requires_dist": ["apache-tvm-ffi>=0.1.11", "pydantic", "torch>=1.10.0", "transformers>=4.38.0",
                          'triton; platform_system == "Linux" and platform_machine == "x86_64"', "numpy",
                          "typing-extensions>=4.9.0"],
        "pypi_default_resolution_wheels_gb": 3.0,
        "venv_with_cpu_torch_installed_gb": 2.2,
    },
    "llguidance": {"version": "1.9.1", "wheel_mb": 3.1, "requires_dist": [], "installed_mb": 7.8},
}


def stats_us(seconds: list[float]) -> dict:
    if not seconds:
        return {"n": 0}
    a = np.asarray(seconds) * 1e6
    return {"n": int(a.size), "median_us": float(np.median(a)), "p99_us": float(np.percentile(a, 99)),
            "max_us": float(a.max()), "mean_us": float(a.mean())}


def allowed(mask_row: np.ndarray, n_vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:n_vocab])


def footprint(dist_name: str) -> dict:
    """Installed bytes of `dist_name` and of its requirements' closure (the installed ones)."""
    def size(dist) -> int:
        total = 0
        for f in dist.files or []:
            try:
                total += os.path.getsize(dist.locate_file(f))
            except OSError:
                pass
        return total

    try:
        root = md.distribution(dist_name)
    except md.PackageNotFoundError:
        return {"installed": False}
    seen, todo, sizes = set(), [root], {}
    while todo:
        dist = todo.pop()
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if name in seen:
            continue
        seen.add(name)
        sizes[name] = size(dist)
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            dep = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req).group(0)
            try:
                todo.append(md.distribution(dep))
            except md.PackageNotFoundError:
                pass
    own = re.sub(r"[-_.]+", "-", dist_name).lower()
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:6]
    requires = [r for r in root.requires or [] if "extra ==" not in r]
    return {"installed": True, "version": root.version, "requires_dist": requires,
            "own_mb": round(sizes[own] / 1e6, 1), "with_deps_mb": round(sum(sizes.values()) / 1e6, 1),
            "n_dists": len(sizes), "largest_mb": {k: round(v / 1e6, 1) for k, v in biggest}}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: int, threads: int):
        t0 = time.perf_counter()
        import llguidance as llg
        import llguidance.numpy as lln

        self.import_s = time.perf_counter() - t0
        self.llg, self.lln, self.n_vocab, self.eos = llg, lln, n_vocab, eos
        t0 = time.perf_counter()
        self.tok = llg.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=[eos])
        self.setup_s = time.perf_counter() - t0
        self.executor = llg.LLExecutor(num_threads=threads)
        self.version = md.version("llguidance")
        self.overrides = {"whitespace_flexible": False, "item_separator": SEPARATORS[0],
                          "key_separator": SEPARATORS[1]}

    def compile(self, schema: dict):
        g = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=self.overrides)
        matcher = self.llg.LLMatcher(self.tok, g, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return g, matcher

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled, log_level=0)

    def warnings(self, matcher) -> list[str]:
        return list(matcher.get_grammar_warnings())

    def alloc(self, batch: int) -> np.ndarray:
        return self.lln.allocate_token_bitmask(batch, self.n_vocab)

    def fill(self, matcher, mask: np.ndarray, index: int) -> None:
        self.lln.fill_next_token_bitmask(matcher, mask, index)

    def fill_batch(self, matchers: list, mask: np.ndarray) -> None:
        self.lln.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: int, threads: int):
        t0 = time.perf_counter()
        import xgrammar as xgr

        self.import_s = time.perf_counter() - t0
        import tokenizers

        self.xgr, self.n_vocab, self.eos = xgr, n_vocab, eos
        t0 = time.perf_counter()
        parsed = json.loads(tokenizer_json)
        vocab = [""] * n_vocab
        for token, i in tokenizers.Tokenizer.from_str(tokenizer_json).get_vocab(with_added_tokens=True).items():
            if i < n_vocab:
                vocab[i] = token
        for added in parsed.get("added_tokens", []):  # "" is how xgrammar recognises a special token
            if added.get("special") and added["id"] != eos:
                vocab[added["id"]] = ""
        byte_level = (parsed.get("decoder") or {}).get("type") == "ByteLevel"
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL if byte_level else xgr.VocabType.RAW,
                                 vocab_size=n_vocab, stop_token_ids=[eos], add_prefix_space=False)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=threads)
        self.version = md.version("xgrammar")
        self.special_token_ids = list(info.special_token_ids)

    def compile(self, schema: dict):
        # strict_mode=False: JSON Schema's own semantics (the suite states additionalProperties itself)
        g = self.compiler.compile_json_schema(schema, any_whitespace=False, separators=SEPARATORS,
                                              strict_mode=False)
        return g, self.xgr.GrammarMatcher(g)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def warnings(self, matcher) -> list[str]:
        return []  # logged to stderr, captured by bench_compile

    def alloc(self, batch: int) -> np.ndarray:
        return np.full(((batch, (self.n_vocab + 31) // 32)), -1, dtype=np.int32)  # passed via DLPack

    def fill(self, matcher, mask: np.ndarray, index: int) -> None:
        matcher.fill_next_token_bitmask(mask, index)

    def fill_batch(self, matchers: list, mask: np.ndarray) -> None:
        self.batch_matcher.batch_fill_next_token_bitmask(matchers, mask)

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


@contextlib.contextmanager
def stderr_captured(sink: list):
    """Collect what native code writes to file descriptor 2 (xgrammar logs its warnings there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.extend(line for line in tmp.read().decode(errors="replace").splitlines() if line.strip())


def bench_compile(lib, cases, reps: int) -> dict:
    per = {}
    compiled = {}
    mask = lib.alloc(1)
    warnings = {}
    for case in cases:
        messages = []
        with stderr_captured(messages):  # once untimed: a warm-up, and the library's warnings
            _, matcher = lib.compile(case.schema)
        messages += lib.warnings(matcher)
        if messages:
            warnings[case.name] = [re.sub(r"^\[[0-9:]+\] \S+: ", "", m) for m in messages]
        times, firsts = [], []
        with stderr_captured([]):  # the same warnings again
            for _ in range(reps):
                t0 = time.perf_counter()
                g, matcher = lib.compile(case.schema)
                t1 = time.perf_counter()
                lib.fill(matcher, mask, 0)
                t2 = time.perf_counter()
                times.append(t1 - t0)
                firsts.append(t2 - t1)
        compiled[case.name] = g
        per[case.name] = {"compile_ms": statistics.median(times) * 1e3,
                          "first_mask_ms": statistics.median(firsts) * 1e3}
    c = [v["compile_ms"] for v in per.values()]
    f = [v["first_mask_ms"] for v in per.values()]
    cf = [v["compile_ms"] + v["first_mask_ms"] for v in per.values()]
    summary = {"compile_median_ms": statistics.median(c), "compile_max_ms": max(c),
               "first_mask_median_ms": statistics.median(f), "first_mask_max_ms": max(f),
               "compile_plus_first_mask_median_ms": statistics.median(cf), "compile_plus_first_mask_max_ms": max(cf),
               "slowest": max(per, key=lambda k: per[k]["compile_ms"] + per[k]["first_mask_ms"])}
    return {"per_schema": per, **summary, "warnings": warnings}, compiled


class Walk:
    """One lane: documents of one schema, one after the other, each a random valid walk."""

    def __init__(self, lib, case, compiled, rng, tokenizer: Tokenizer, record: dict):
        self.lib, self.case, self.compiled, self.rng = lib, case, compiled, rng
        self.tok, self.record = tokenizer, record
        self.start()

    def start(self):
        self.matcher = self.lib.matcher(self.compiled)
        self.tokens = []

    def step(self, mask_row: np.ndarray) -> float:
        """Pick and consume a token from this lane's filled mask; returns the consume time."""
        ok = allowed(mask_row, self.lib.n_vocab)
        if ok.size == 0:
            self.record["empty_masks"] += 1
            self.start()
            return 0.0
        token = self.lib.eos if self.lib.eos in ok else int(self.rng.choice(ok))
        t0 = time.perf_counter()
        accepted = self.lib.consume(self.matcher, token)
        dt = time.perf_counter() - t0
        if not accepted:
            self.record["rejected_tokens"] += 1
            self.start()
            return dt
        if token != self.lib.eos:
            self.tokens.append(token)
        if token == self.lib.eos or self.lib.done(self.matcher):
            self.finish()
        return dt

    def finish(self):
        text = self.tok.decode(self.tokens)
        self.record["documents"] += 1
        self.record["tokens_per_document"].append(len(self.tokens))
        try:
            validate(self.case, text)
        except Exception as e:  # json or jsonschema
            self.record["invalid"] += 1
            self.record["invalid_schemas"][self.case.name] = self.record["invalid_schemas"].get(self.case.name, 0) + 1
            if len(self.record["invalid_examples"]) < 5:
                error = str(e).splitlines()[0][:200]
                self.record["invalid_examples"].append({"schema": self.case.name, "text": text, "error": error})
        self.start()


def new_record() -> dict:
    return {"documents": 0, "invalid": 0, "invalid_schemas": {}, "invalid_examples": [], "empty_masks": 0,
            "rejected_tokens": 0, "tokens_per_document": []}


def bench_walks(lib, cases, compiled, tokenizer, n_tokens: int, batch: int, seed: int) -> dict:
    out = {}
    # batch 1: each schema walked for n_tokens steps
    record, fills, consumes = new_record(), [], []
    mask = lib.alloc(1)
    for k, case in enumerate(cases):
        lane = Walk(lib, case, compiled[case.name], np.random.default_rng(seed + k), tokenizer, record)
        for _ in range(n_tokens):
            t0 = time.perf_counter()
            lib.fill(lane.matcher, mask, 0)
            fills.append(time.perf_counter() - t0)
            consumes.append(lane.step(mask[0]))
        # the unfinished document is dropped
    out["b1"] = {"mask": stats_us(fills), "consume": stats_us(consumes), **summarise(record)}
    # a batch of lanes, one schema each (round robin), filled together or in a loop
    for mode in ("together", "loop"):
        record, fills, consumes = new_record(), [], []
        mask = lib.alloc(batch)
        lanes = [Walk(lib, cases[i % len(cases)], compiled[cases[i % len(cases)].name],
                      np.random.default_rng(seed + 1000 + i), tokenizer, record) for i in range(batch)]
        for _ in range(n_tokens):
            matchers = [lane.matcher for lane in lanes]
            t0 = time.perf_counter()
            if mode == "together":
                lib.fill_batch(matchers, mask)
            else:
                for i, m in enumerate(matchers):
                    lib.fill(m, mask, i)
            fills.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i, lane in enumerate(lanes):
                lane.step(mask[i])
            consumes.append(time.perf_counter() - t0)
        step = stats_us(fills)
        step["per_matcher_median_us"] = step["median_us"] / batch
        out[f"b{batch}_{mode}"] = {"mask_step": step, "consume_step_incl_sampling": stats_us(consumes),
                                   **summarise(record)}
    return out


def summarise(record: dict) -> dict:
    tpd = record.pop("tokens_per_document")
    record["median_tokens_per_document"] = float(np.median(tpd)) if tpd else None
    return record


def run_lib(cls, tokenizer_json, tokenizer, cases, args) -> dict:
    lib = cls(tokenizer_json, tokenizer.vocab_size, tokenizer.eos_token_ids[0], args.threads)
    res = {"version": lib.version, "import_s": lib.import_s, "tokenizer_setup_s": lib.setup_s}
    if hasattr(lib, "special_token_ids"):
        res["special_token_ids"] = lib.special_token_ids
    res["compile"], compiled = bench_compile(lib, cases, args.compile_reps)
    bounded = [c for c in cases if c.bounded]
    res["walks"] = bench_walks(lib, bounded, compiled, tokenizer, args.tokens, args.batch, args.seed)
    res["footprint"] = footprint(lib.name)
    return res


def print_table(results: dict, batch: int) -> None:
    names = list(results["libs"])
    rows = [("version", lambda r: r["version"]),
            ("import (s)", lambda r: f"{r['import_s']:.2f}"),
            ("tokenizer set-up (ms)", lambda r: f"{r['tokenizer_setup_s'] * 1e3:.0f}"),
            ("compile median / max (ms)", lambda r: f"{r['compile']['compile_median_ms']:.2f} / "
                                                   f"{r['compile']['compile_max_ms']:.2f}"),
            ("first mask median / max (ms)", lambda r: f"{r['compile']['first_mask_median_ms']:.2f} / "
                                                      f"{r['compile']['first_mask_max_ms']:.2f}"),
            ("slowest schema", lambda r: r["compile"]["slowest"]),
            ("b1 mask median/p99/max (us)", lambda r: fmt3(r["walks"]["b1"]["mask"])),
            ("b1 consume median/p99/max (us)", lambda r: fmt3(r["walks"]["b1"]["consume"])),
            (f"b{batch} together step med/p99/max (us)", lambda r: fmt3(r["walks"][f"b{batch}_together"]["mask_step"])),
            (f"b{batch} loop step med/p99/max (us)", lambda r: fmt3(r["walks"][f"b{batch}_loop"]["mask_step"])),
            ("walk docs / invalid / rejected", lambda r: " / ".join(
                str(sum(w[k] for w in r["walks"].values())) for k in ("documents", "invalid", "rejected_tokens"))),
            ("installed MB own / with deps", lambda r: f"{r['footprint'].get('own_mb')} / "
                                                      f"{r['footprint'].get('with_deps_mb')}")]
    width = max(len(label) for label, _ in rows)
    print(f"{'':{width}}  " + "  ".join(f"{n:>28}" for n in names))
    for label, get in rows:
        print(f"{label:{width}}  " + "  ".join(f"{get(results['libs'][n]):>28}" for n in names))
    for n in names:
        for schema, messages in results["libs"][n]["compile"]["warnings"].items():
            print(f"{n} warns on {schema}: {'; '.join(sorted(set(messages)))}")
    for n in names:
        seen = set()
        for walk in results["libs"][n]["walks"].values():
            for ex in walk["invalid_examples"]:
                if ex["schema"] not in seen:
                    seen.add(ex["schema"])
                    print(f"{n} let through, for {ex['schema']}: {ex['text'][:110]!r}: {ex['error'][:80]}")


def fmt3(s: dict) -> str:
    return f"{s['median_us']:.0f} / {s['p99_us']:.0f} / {s['max_us']:.0f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    p.add_argument("--libs", nargs="+", default=["llguidance", "xgrammar"], choices=["llguidance", "xgrammar"])
    p.add_argument("--tokens", type=int, default=100, help="walk steps per schema (batch 1) and per lane (batch)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--compile-reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_grammar_libs.json")
    args = p.parse_args(argv)

    tokenizer = Tokenizer.load(args.checkpoint)
    tokenizer_json = tokenizer._backend.tokenizer.to_str()
    results = {"machine": {"cpus": os.cpu_count(), "threads": args.threads, "python": platform.python_version(),
                           "platform": platform.platform()},
               "args": vars(args), "schemas": len(SCHEMAS), "bounded_schemas": sum(c.bounded for c in SCHEMAS),
               "known_footprint": KNOWN_FOOTPRINT, "libs": {}, "skipped": {}}
    for name in args.libs:
        cls = {"llguidance": LLGuidance, "xgrammar": XGrammar}[name]
        if importlib.util.find_spec(name) is None:  # find_spec, not import: run_lib times the import
            results["skipped"][name] = "not installed"
            print(f"{name}: not installed here; skipped", file=sys.stderr)
            continue
        print(f"{name}: measuring ...", file=sys.stderr)
        results["libs"][name] = run_lib(cls, tokenizer_json, tokenizer, SCHEMAS, args)
    print(f"{len(SCHEMAS)} schemas ({results['bounded_schemas']} bounded, walked), {args.tokens} steps per walk, "
          f"{os.cpu_count()} CPUs, {args.threads} threads, Python {platform.python_version()}")
    if results["libs"]:
        print_table(results, args.batch)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
