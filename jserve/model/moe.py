"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): routing and the grouped expert matmuls.

`moe_mlp` is the layer's MLP (its docstring lists the weights); `route` is the softmax top-k
routing, `routed_experts` sorts the (token, choice) pairs by expert and runs them through a grouped
matmul (`grouped_matmul`: "ragged_dot" on TPU / GPU, "gather" on a CPU), and `_mesh_experts`
splits the experts over a mesh's `ep` axis. See docs/architecture.md, "The model".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jserve.model import quant
from jserve.model.config import ModelConfig

ROUTER = "w_router"
EXPERT_WEIGHTS = ("we_gate", "we_up", "we_down")
SHARED_WEIGHTS = ("ws_gate", "ws_up", "ws_down")
SHARED_GATE = "ws_router"
GROUPED_MATMULS = ("ragged_dot", "gather")


def init_params(layer: Any, c: ModelConfig, param) -> None:
    """Give `layer` (a `DecoderLayer`) its MoE weights; `param(shape)` makes one (with the layer axis)."""
    D, E, F = c.hidden_size, c.num_experts, c.moe_intermediate_size
    layer.w_router = param((D, E))
    layer.we_gate, layer.we_up, layer.we_down = param((E, D, F)), param((E, D, F)), param((E, F, D))
    if c.shared_expert_intermediate_size:
        S = c.shared_expert_intermediate_size
        layer.ws_gate, layer.ws_up, layer.ws_down = param((D, S)), param((D, S)), param((S, D))
        if c.shared_expert_gate:
            layer.ws_router = param((D, 1))


def route(x: jax.Array, w_router: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """x [tokens, hidden] -> (weights float32 [tokens, k], experts int32 [tokens, k]): the top-k
    of the softmax over the router's logits (computed in x's dtype, as transformers does),
    renormalised to sum to 1 if `normalize` (`norm_topk_prob`: Qwen3-MoE's checkpoints, Mixtral
    always; not Qwen2-MoE)."""
    probs = jax.nn.softmax((x @ w_router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _gather_tiles(rows: int, groups: int) -> tuple[int, int]:
    """(tile, tiles) for `rows` sorted rows in `groups` groups: tiles of one row for decode-sized
    steps, else of about rows / groups rows; `tiles` bounds sum over groups of ceil(size / tile)."""
    tile = max(1, rows // groups)
    tile = 1 << (tile.bit_length() - 1)  # a power of two: fewer distinct shapes
    return tile, (rows + min(groups, rows) * (tile - 1)) // tile


def gather_matmul(xs: jax.Array, w: jax.Array, group: jax.Array, sizes: jax.Array) -> jax.Array:
    """Rows of xs [rows, in], sorted by `group` [rows] (values 0..G; G: no group, their outputs
    are garbage and must be masked), times their group's w [G, in, out]: each group's rows padded
    to whole tiles, each tile's weights gathered, one batched matmul. `sizes` [G]: rows per group."""
    rows, G = xs.shape[0], w.shape[0]
    tile, tiles = _gather_tiles(rows, G)
    padded = (sizes + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    start = jnp.cumsum(sizes) - sizes
    g = jnp.minimum(group, G - 1)
    pos = jnp.where(group < G, padded_end[g] - padded[g] + jnp.arange(rows) - start[g], tiles * tile)
    xp = jnp.zeros((tiles * tile, xs.shape[1]), xs.dtype).at[pos].set(xs, mode="drop")
    tile_group = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(tiles) * tile, side="right"), G - 1)
    yp = jnp.einsum("tri,tio->tro", xp.reshape(tiles, tile, -1), w[tile_group],
                    preferred_element_type=xs.dtype)
    return yp.reshape(tiles * tile, -1)[jnp.minimum(pos, tiles * tile - 1)]


def grouped_matmul(xs, w, group, sizes, impl: str):
    """`gather_matmul`'s contract by `impl` ("ragged_dot" or "gather").

    The experts (`routed_experts`): the (token, choice) pairs are sorted by expert, each expert's
    rows run through its own weights only, and the outputs are weighted and summed back per token.
    Two grouped matmuls compute "rows of group g times w[g]" without computing every expert for
    every token:

    - "ragged_dot": `jax.lax.ragged_dot` with the group sizes (TPU's and GPU's native grouped matmul).
      XLA:CPU has none: JAX lowers it there to a dense dot of every row with every group, masked, so
      it costs `experts` times the work; correct, and what the plain `XlaOps` uses by default.
    - "gather": the rows are laid out in tiles of one expert each (each group padded to a whole
      number of tiles) and each tile's expert weights are gathered (`w[tile_expert]`) for a batched
      matmul. A decode step (tiles of one row) reads just the selected experts' weights, so its
      cost grows with the active experts, not the total; prefill tiles of rows / experts rows keep
      the gathered weights within about twice the experts'. What the CPU backends run.
    """
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(xs, w, sizes)
    if impl == "gather":
        return gather_matmul(xs, w, group, sizes)
    raise ValueError(f"grouped matmul must be one of {GROUPED_MATMULS}, got {impl!r}")


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate, w_up, w_down, *,
                   first: Any = 0, impl: str = "ragged_dot") -> jax.Array:
    """sum over k of weights[t, k] * expert[experts[t, k]](x[t]) over the experts this device holds:
    w_* [local experts, ...] are experts first .. first + local - 1; pairs routed elsewhere add 0.
    x [tokens, hidden]; weights, experts [tokens, k]. Returns [tokens, hidden] in x's dtype."""
    N, k = experts.shape
    G = w_gate.shape[0]
    local_id = experts.reshape(-1) - first
    local = (local_id >= 0) & (local_id < G)
    key = jnp.where(local, local_id, G)  # pairs of other devices' experts sort last
    order = jnp.argsort(key, stable=True)
    group = key[order]
    token = order // k
    sizes = jnp.bincount(key, length=G + 1)[:G].astype(jnp.int32)
    xs = x[token]
    gate = grouped_matmul(xs, w_gate, group, sizes, impl)
    up = grouped_matmul(xs, w_up, group, sizes, impl)
    out = grouped_matmul(jax.nn.silu(gate) * up, w_down, group, sizes, impl)
    scale = weights.reshape(-1)[order].astype(x.dtype)
    out = jnp.where((group < G)[:, None], out * scale[:, None], jnp.zeros((), out.dtype))
    return jnp.zeros((N, x.shape[1]), out.dtype).at[token].add(out).astype(x.dtype)


def _mesh_experts(mesh, x, weights, experts, w_gate, w_up, w_down, impl):
    """`routed_experts` with the experts split over the mesh's `ep` axis and their width over
    `tp`, inside shard_map; one psum over (ep, tp).

    Expert parallelism (`ops.mesh` with an `ep` axis): the expert weights are split on their expert
    axis over `ep` (and their width over `tp`); inside `shard_map` each device routes all of its dp
    group's tokens (the activations are replicated over ep and tp, as for attention), computes only
    the pairs routed to its own experts, and one `psum` over (ep, tp) sums the partial outputs: the
    same one all-reduce of [tokens, hidden] per layer that a tensor-parallel MLP does, and no
    expert weight ever moves. (An all-to-all dispatch would move only the routed rows, but needs the
    tokens split over ep, i.e. attention data-parallel over ep: the runner's batch layout, not the
    layer's. Here attention runs replicated over ep.)
    """
    from jax.sharding import PartitionSpec as P

    names = mesh.axis_names
    sizes = dict(zip(names, mesh.devices.shape))
    ep = "ep" if sizes.get("ep", 1) > 1 else None
    tp = "tp" if sizes.get("tp", 1) > 1 else None
    dp = "dp" if sizes.get("dp", 1) > 1 and x.shape[0] % sizes["dp"] == 0 else None
    reduce = tuple(a for a in (ep, tp) if a)
    if w_gate.shape[0] % sizes.get("ep", 1) or w_gate.shape[2] % sizes.get("tp", 1):
        raise ValueError(f"experts {w_gate.shape} do not split over ep={sizes.get('ep', 1)}, "
                         f"tp={sizes.get('tp', 1)} (jserve.runtime.sharding lays them out)")

    def local(x, weights, experts, w_gate, w_up, w_down):
        first = jax.lax.axis_index("ep") * w_gate.shape[0] if ep else 0
        y = routed_experts(x, weights, experts, w_gate, w_up, w_down, first=first, impl=impl)
        return jax.lax.psum(y, reduce) if reduce else y

    rows = P(dp, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, P(ep, None, tp), P(ep, None, tp),
                                                      P(ep, tp, None)),
                         out_specs=rows, check_vma=False)(x, weights, experts, w_gate, w_up, w_down)


def moe_mlp(layer: Any, h: jax.Array, ops: Any) -> jax.Array:
    """A MoE layer's MLP: h [batch, tokens, hidden] (after the pre-MLP norm) -> its output.

    `ops.grouped_matmul` ("ragged_dot" or "gather", default "ragged_dot") picks the grouped
    matmul; `ops.mesh` (default None), when set, splits the experts over its ep and tp axes.

    A MoE layer's weights (checkpoints stack them on a leading layer axis, as every layer weight):

        w_router   [hidden, experts]               the router's logits
        we_gate    [experts, hidden, moe_ffn]      every expert's SwiGLU, [in, out] per expert
        we_up      [experts, hidden, moe_ffn]
        we_down    [experts, moe_ffn, hidden]
        ws_gate, ws_up [hidden, shared_ffn], ws_down [shared_ffn, hidden]   a shared expert (Qwen2-MoE)
        ws_router  [hidden, 1]                     the shared expert's sigmoid gate (Qwen2-MoE)
    """
    c: ModelConfig = layer.config
    B, T, D = h.shape
    x = h.reshape(B * T, D)
    w_gate, w_up, w_down = (getattr(layer, n).get_value() for n in EXPERT_WEIGHTS)
    if any(quant.is_quantized(w) for w in (w_gate, w_up, w_down)):
        raise NotImplementedError("quantized expert weights are not supported yet: serve a MoE model in float")
    weights, experts = route(x, layer.w_router[...], c.num_experts_per_tok, c.norm_topk_prob)
    impl = getattr(ops, "grouped_matmul", None) or "ragged_dot"
    mesh = getattr(ops, "mesh", None)
    if mesh is not None and mesh.devices.size > 1:
        y = _mesh_experts(mesh, x, weights, experts, w_gate, w_up, w_down, impl)
    else:
        y = routed_experts(x, weights, experts, w_gate, w_up, w_down, impl=impl)
    if c.shared_expert_intermediate_size:
        S = c.shared_expert_intermediate_size
        gate, up = ops.linear(x, (layer.ws_gate.get_value(), layer.ws_up.get_value()), (S, S))
        shared = ops.linear(jax.nn.silu(gate) * up, layer.ws_down.get_value(), D)
        if c.shared_expert_gate:
            shared = jax.nn.sigmoid(x @ layer.ws_router[...]) * shared
        y = y + shared
    return y.reshape(B, T, D)
