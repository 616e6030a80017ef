"""`jserve plan`'s sequences by page-keeping rule (`jserve.runtime.kv_concurrency`): the tiny
configs against hand-computed figures, and the window bound against the page table itself."""

from __future__ import annotations

import dataclasses
import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DATA
from jserve import cli
from jserve.core.page_table import PageTable
from jserve.model.config import ModelConfig
from jserve.runtime.kv_concurrency import concurrency


def _config(arch: str) -> ModelConfig:
    return ModelConfig.from_hf_config(json.loads((DATA / "arch" / arch / "config.json").read_text()))


def test_gemma3_hybrid_pages():
    """4 layers, 3 sliding (window 8); context 64 in pages of 4: 16 pages; a sliding layer keeps
    cdiv(8 - 1 + 16, 4) + 1 = 7. 100 pages hold 400 layer-pages, a sequence takes
    16 + 3 * 7 = 37 of them: 10 sequences, against 100 // 16 = 6 with every page."""
    c = concurrency(_config("gemma3"), context=64, page_size=4, num_pages=101, max_num_batched_tokens=16)
    assert (c.full_pages, c.window_pages, c.sliding_layers) == (16, 7, 3)
    assert (c.every_page, c.window_rule) == (6, 10)
    assert not c.shared_window and c.hit_pages == 16  # full layers read every page of a hit
    # The engine's two pools: 400 layer-pages less 4 null pages, 37 a sequence: 10.7 sequences' worth.
    sequences, full, local = c.hybrid(16)
    assert sequences == 10 and full + 3 * local <= 4 * 101 and (full - 1) // 16 == (local - 1) // 7 == 10


def test_mistral_window_hits_and_host_tier():
    """Window 8 on both layers, pages of 4: 7 pages a sequence, 100 // 7 = 14; a hit needs
    cdiv(8 - 1, 4) = 2 pages, so 50 prefixes stay hittable (6 with every page); a host tier of
    10 pages more: (100 + 10) // 2 = 55."""
    c = concurrency(_config("mistral"), context=64, page_size=4, num_pages=101, max_num_batched_tokens=16,
                    host_bytes=10 * 1024 + 1000, host_page_bytes=1024)
    assert c.shared_window and (c.window_rule, c.hit_pages, c.host_pages) == (14, 2, 10)
    assert (c.prefixes_kept(window_rule=False), c.prefixes_kept(), c.prefixes_kept(host=True)) == (6, 50, 55)
    short = concurrency(_config("mistral"), context=6, page_size=4, num_pages=101, max_num_batched_tokens=16)
    assert short.window_pages == short.full_pages == short.hit_pages == 2  # the window never binds


def test_no_window_keeps_every_page():
    c = concurrency(_config("llama3"), context=64, page_size=4, num_pages=101, max_num_batched_tokens=16,
                    host_bytes=4096, host_page_bytes=1024)
    assert c.window is None and c.sliding_layers == 0 and c.window_rule == c.every_page == 6
    assert c.prefixes_kept() == 6 and c.prefixes_kept(host=True) == 104 // 16


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 12), page_size=st.integers(1, 4), chunk=st.integers(1, 8), context=st.integers(1, 40))
def test_the_page_table_holds_at_most_the_window_pages(window, page_size, chunk, context):
    """The figure is a bound the page table keeps: a sequence prefilled in chunks, then decoded
    to `context` tokens, never holds more than `window_pages` pages."""
    mistral = dataclasses.replace(_config("mistral"), sliding_window=window)
    bound = concurrency(mistral, context=context, page_size=page_size, num_pages=2,
                        max_num_batched_tokens=chunk).window_pages
    pt = PageTable(64, page_size, sliding_window=window)
    prompt = list(range(max(1, context // 2)))
    pt.allocate_prompt("a", prompt, num_new_tokens=min(chunk, len(prompt)))
    while True:
        held = pt.page_ids("a")
        assert len(held) - held.count(0) <= bound
        computed = pt.num_allocated_tokens("a")
        pt.mark_computed("a", computed - pt.num_computed_tokens("a"))
        if computed == context:
            break
        if computed == pt.num_tokens("a"):
            pt.append_tokens("a", [computed])
        assert pt.allocate_slots("a", min(chunk, pt.num_tokens("a") - computed))
    pt.free("a")
    assert pt.pool.num_used_pages == 0


def test_plan_cli_rows(capsys):
    """1 MiB of float32 KV: gemma2 (3 layers, 2 KV heads of 16: 768 B a token) has 341 pages of
    4 tokens, 340 usable; 16 a sequence of 64 tokens, 7 a sliding layer's: 340 * 3 // (16 + 2 * 7)
    = 34 with hybrid pages (545 pages for the full layer, 239 for each sliding one: 3 * 341 layer-pages
    at most) against 21. Mistral (256 B a token) has 1023 usable pages: 146 under
    the window rule, 511 prefixes kept (2 pages each), 543 with 64 host pages of 1 KiB."""
    args = ["--kv-budget", "1MiB", "--context", "64", "--page-size", "4", "--max-num-batched-tokens", "16"]
    assert cli.main(["plan", "--model", str(DATA / "arch" / "gemma2"), *args]) == 0
    out = capsys.readouterr().out
    assert re.search(r"hybrid pages \(2 of 3 layers keep a window of 8\)\s+34 \(545 pages for each full layer, "
                     r"239 for each sliding one; 21 with one pool", out), out
    assert cli.main(["plan", "--model", str(DATA / "arch" / "mistral"), *args, "--kv-offload-bytes", "64KiB"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"pages behind the window \(8\) given back\s+146 \(7 pages each", out), out
    assert re.search(r"kept hittable\s+511 \(a hit needs its last 2 pages; 63 if", out), out
    assert re.search(r"host tier of 64 KiB\s+543 \(64 host pages of 1 KiB", out), out
