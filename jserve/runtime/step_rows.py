"""A step's rows on the host: packed into the padded arrays a compiled step takes, and costed.

Pure numpy and arithmetic, no device state (`jserve.runtime.runner` owns that). A row is a
`jserve.runtime.steps.StepRow` (tokens at positions `start .. start + len(token_ids) - 1`, whose pages,
and the earlier ones, are `page_ids`); None is a padding row. The packed `positions` are the
model's rotary positions: given the model's config, a LongRoPE model's rows whose sequence is
longer than its original context carry `LONG_ROPE_FLAG` (`rope_positions`); slots and the
attention's lengths come from the plain positions.
"""

from __future__ import annotations

import numpy as np

from jserve.model.config import LONG_ROPE_FLAG, ModelConfig
from jserve.runtime.paged_attention import PagedMeta, RaggedMeta


def rope_positions(row, pos: np.ndarray, config: ModelConfig | None) -> np.ndarray:
    """The row's positions `pos` as the model rotates them: with `LONG_ROPE_FLAG` where `config`
    is LongRoPE's and the row's sequence (`StepRow.seq_len`, else the row's end) is longer than
    its original context."""
    if config is None or not config.long_rope(max(row.seq_len, row.start + row.num_tokens)):
        return pos
    return pos + LONG_ROPE_FLAG


def _local_table(row) -> np.ndarray:
    """The row's sliding layers' pages (hybrid pages), which it must have."""
    if row.local_page_ids is None:
        raise ValueError(f"a row at position {row.start} has no local_page_ids, which a runner with hybrid "
                         "pages needs (its scheduler's page table must be a HybridPageTable)")
    return np.asarray(row.local_page_ids, np.int32)


def pack(rows, B: int, T: int, *, max_pages: int, page_size: int, config: ModelConfig | None = None,
         hybrid: bool = False):
    """`(tokens, positions, PagedMeta, last)` for B rows of T tokens: each row's tokens, their
    positions and K/V slots, its page table padded with the null page 0 (where padding writes),
    and the index of its last token (-1 for a padding row). `hybrid`: the sliding layers' slots
    and page table too, from each row's `local_page_ids` (`jserve.core.hybrid_pages`)."""
    tokens = np.zeros((B, T), np.int32)
    positions = np.zeros((B, T), np.int32)
    slots = np.zeros((B, T), np.int32)  # padding writes into the null page
    q_start = np.zeros((B,), np.int32)
    q_lens = np.zeros((B,), np.int32)
    page_indices = np.zeros((B, max_pages), np.int32)
    local_slots = np.zeros((B, T), np.int32) if hybrid else None
    local_pages = np.zeros((B, max_pages), np.int32) if hybrid else None
    for b, row in enumerate(rows):
        if row is None:
            continue
        start, ids, pages = row.start, row.token_ids, row.page_ids
        n = len(ids)
        pos = np.arange(start, start + n)
        tokens[b, :n] = ids
        positions[b, :n] = rope_positions(row, pos, config)
        table = np.asarray(pages, np.int32)
        slots[b, :n] = table[pos // page_size] * page_size + pos % page_size
        q_start[b], q_lens[b] = start, n
        page_indices[b, :len(pages)] = pages
        if hybrid:
            local = _local_table(row)
            local_slots[b, :n] = local[pos // page_size] * page_size + pos % page_size
            local_pages[b, :len(local)] = local
    meta = PagedMeta(slots.reshape(-1), q_start, q_lens, page_indices,
                     None if local_slots is None else local_slots.reshape(-1), local_pages)
    return tokens, positions, meta, q_lens - 1


def pack_ragged(groups, R: int, N: int, *, max_pages: int, page_size: int, config: ModelConfig | None = None,
                hybrid: bool = False):
    """`(tokens, positions, RaggedMeta, last)` of a mixed step: per group (a list of rows each,
    at most R rows and N tokens), its rows' tokens one after another in its block of N tokens
    (padding tokens write into the null page), the rows' lengths, page tables and bounds, and
    `last` int32 [groups, R]: the index in the block of each row's last token (-1: padding).
    `hybrid`: the sliding layers' slots and page tables too, as `pack`'s."""
    G = len(groups)
    tokens = np.zeros((G, N), np.int32)
    positions = np.zeros((G, N), np.int32)
    slots = np.zeros((G, N), np.int32)
    kv_lens = np.zeros((G, R), np.int32)
    page_indices = np.zeros((G, R, max_pages), np.int32)
    cu_q_lens = np.zeros((G, R + 1), np.int32)
    num_rows = np.zeros((G,), np.int32)
    last = np.full((G, R), -1, np.int32)
    local_slots = np.zeros((G, N), np.int32) if hybrid else None
    local_pages = np.zeros((G, R, max_pages), np.int32) if hybrid else None
    for g, rows in enumerate(groups):
        if len(rows) > R or sum(r.num_tokens for r in rows) > N:
            raise ValueError(f"group {g}: {len(rows)} rows of {sum(r.num_tokens for r in rows)} tokens "
                             f"exceed a mixed step of {R} rows and {N} tokens")
        t = 0
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            pos = np.arange(row.start, row.start + n)
            table = np.asarray(row.page_ids, np.int32)
            tokens[g, t:t + n] = row.token_ids
            positions[g, t:t + n] = rope_positions(row, pos, config)
            slots[g, t:t + n] = table[pos // page_size] * page_size + pos % page_size
            kv_lens[g, i] = row.start + n
            page_indices[g, i, :len(table)] = table
            if hybrid:
                local = _local_table(row)
                local_slots[g, t:t + n] = local[pos // page_size] * page_size + pos % page_size
                local_pages[g, i, :len(local)] = local
            t += n
            cu_q_lens[g, i + 1] = t
            last[g, i] = t - 1
        cu_q_lens[g, len(rows) + 1:] = t
        num_rows[g] = len(rows)
    meta = RaggedMeta(slots.reshape(-1), kv_lens.reshape(-1), page_indices.reshape(G * R, max_pages),
                      cu_q_lens.reshape(-1), num_rows, None if local_slots is None else local_slots.reshape(-1),
                      None if local_pages is None else local_pages.reshape(G * R, max_pages))
    return tokens, positions, meta, last


def lora_ids(rows, B: int, T: int) -> np.ndarray:
    """int32 [B, T]: each row's LoRA slot (`StepRow.lora_slot`) over its tokens, 0 for padding."""
    ids = np.zeros((B, T), np.int32)
    for b, row in enumerate(rows):
        if row is not None:
            ids[b, :row.num_tokens] = row.lora_slot
    return ids


def lora_ids_ragged(groups, N: int) -> np.ndarray:
    """int32 [groups, N]: a mixed step's tokens' LoRA slots, laid out as `pack_ragged` lays the tokens."""
    ids = np.zeros((len(groups), N), np.int32)
    for g, rows in enumerate(groups):
        t = 0
        for row in rows:
            ids[g, t:t + row.num_tokens] = row.lora_slot
            t += row.num_tokens
    return ids


def cost(config: ModelConfig, rows, *, param_bytes: int, num_params: int, kv_itemsize: int,
         kv_scale_bytes: int = 0) -> tuple[int, int]:
    """The bytes and FLOPs a step over these (real) rows needs at minimum: weights read once plus
    the K/V read and written (a quantized cache's scales, `kv_scale_bytes` per token and KV head,
    included), and the matmuls and attention of the real tokens (the physical floor behind the
    metrics' bandwidth and FLOP utilisation)."""
    c = config
    kv_token = c.kv_bytes_per_token(kv_itemsize, kv_scale_bytes)
    new = sum(r.num_tokens for r in rows)
    context = sum(r.start + r.num_tokens for r in rows)  # keys each row's last query reads
    # Keys over all queries: query at position p reads p + 1 keys; a closed-form sum per row.
    attended = sum(r.num_tokens * (2 * r.start + r.num_tokens + 1) // 2 for r in rows)
    bytes_needed = param_bytes + kv_token * (context + new)
    # Layers run for every new token; the head only for each row's last (embedding: a lookup).
    layer_params = num_params - c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    flops = 2 * layer_params * new + 2 * c.hidden_size * c.vocab_size * len(rows)
    flops += 4 * c.num_layers * c.num_heads * c.head_dim * attended
    return int(bytes_needed), int(flops)


def pack_mixed(lengths: list[int], *, max_tokens: int, max_rows: int) -> list[list[int]]:
    """Rows (by their token counts) into mixed calls of at most `max_rows` rows and `max_tokens`
    tokens, in order: each call's row indices."""
    packs: list[list[int]] = []
    total = 0
    for j, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"a chunk of {n} tokens exceeds the largest token bucket {max_tokens}: "
                             f"the scheduler must split it")
        if packs and len(packs[-1]) < max_rows and total + n <= max_tokens:
            packs[-1].append(j)
            total += n
        else:
            packs.append([j])
            total = n
    return packs
