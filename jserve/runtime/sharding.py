"""Meshes and PartitionSpecs: tensor-parallel (`tp`), data-parallel (`dp`) and expert-parallel
(`ep`) serving.

A mesh has the named axes `dp` and `tp`, and `ep` when one is given (`"dp=2,tp=4"`,
`"ep=2,tp=2"`; a missing axis has size 1); a dense model refuses an ep above 1. `_spec`'s
docstring is the table of where every weight and the KV pages live (`PARTITION_RULES`), and
`HeadLayout`'s how heads `tp` does not divide are padded or replicated. Data parallel: each of the
`dp` groups owns `num_pages / dp` pages and its own scheduler (`jserve.core.dp_scheduler`), and
its rows occupy one contiguous block of every batch; weights are replicated over `dp`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

import numpy as np

from jserve.model.config import ModelConfig

AXES = ("dp", "tp")
ALL_AXES = ("dp", "ep", "tp")  # a mesh's axes in order; "ep" only where given

# Spec of one layer's (or a global) weight, by name; `_spec` has the table and its reasons.
PARTITION_RULES: dict[str, tuple] = {
    "embed": (None, "tp"),
    "lm_head": (None, "tp"),
    "final_norm": (),
    "attn_norm": (), "mlp_norm": (), "q_norm": (), "k_norm": (), "attn_post_norm": (), "mlp_post_norm": (),
    "wq": (None, "tp"), "wk": (None, "tp"), "wv": (None, "tp"),
    "bq": ("tp",), "bk": ("tp",), "bv": ("tp",),
    "wo": ("tp", None), "bo": (),
    "w_gate": (None, "tp"), "w_up": (None, "tp"), "w_down": ("tp", None),
    "b_gate": ("tp",), "b_up": ("tp",), "b_down": (),
    "w_router": (), "we_gate": ("ep", None, "tp"), "we_up": ("ep", None, "tp"), "we_down": ("ep", "tp", None),
    "ws_gate": (None, "tp"), "ws_up": (None, "tp"), "ws_down": ("tp", None), "ws_router": (),
    "lora_a_wq_wk_wv": (), "lora_a_w_gate_w_up": (), "lora_a_wo": ("tp",), "lora_a_w_down": ("tp",),
    "lora_b_wq": (None, None, "tp"), "lora_b_wk": (None, None, "tp"), "lora_b_wv": (None, None, "tp"),
    "lora_b_w_gate": (None, None, "tp"), "lora_b_w_up": (None, None, "tp"), "lora_b_wo": (), "lora_b_w_down": (),
}
KV_PAGES_SPEC = ("tp", "dp", None, None)


def parse_mesh(spec: str | Mapping[str, int]) -> dict[str, int]:
    """'dp=2,tp=4' -> {'dp': 2, 'tp': 4}; ValueError naming a bad axis or size. 'ep' appears in
    the result only where given ('ep=2,tp=2' -> {'dp': 1, 'tp': 2, 'ep': 2})."""
    if isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        text = spec.strip()
        if not text:
            raise ValueError("empty mesh: give axes like 'tp=4' or 'dp=2,tp=4'")
        items = []
        for part in text.split(","):
            m = re.fullmatch(r"\s*(\w+)\s*[=:]\s*(-?\d+)\s*", part)
            if not m:
                raise ValueError(f"bad mesh axis {part.strip()!r} in {spec!r}: write name=size, e.g. 'dp=2,tp=4'")
            items.append((m.group(1), int(m.group(2))))
    sizes = {"dp": 1, "tp": 1}
    seen = set()
    for name, size in items:
        if name not in ALL_AXES:
            raise ValueError(f"unknown mesh axis {name!r} (axes: {', '.join(ALL_AXES)})")
        if name in seen:
            raise ValueError(f"mesh axis {name!r} given twice in {spec!r}")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name} must have a positive size, got {size!r}")
        seen.add(name)
        sizes[name] = size
    return sizes


def make_mesh(spec: Any, devices: Any = None):
    """A `jax.sharding.Mesh` with axes ('dp', 'tp'), or ('dp', 'ep', 'tp') where an ep axis is
    given, from a spec string, dict or an existing Mesh.

    An existing Mesh must name its axes among 'dp', 'ep', 'tp' (a missing dp or tp is added with size 1).
    """
    import jax
    from jax.sharding import Mesh

    if isinstance(spec, Mesh):
        unknown = [a for a in spec.axis_names if a not in ALL_AXES]
        if unknown:
            raise ValueError(f"mesh axis {unknown[0]!r} is not one of {ALL_AXES}")
        sizes = dict(zip(spec.axis_names, spec.devices.shape))
        axes = AXES if "ep" not in sizes else ALL_AXES
        order = [spec.axis_names.index(a) for a in axes if a in sizes]  # their axes, in our order
        devs = np.transpose(spec.devices, order).reshape([sizes.get(a, 1) for a in axes])
        return Mesh(devs, axes)
    sizes = parse_mesh(spec)
    axes = AXES if "ep" not in sizes else ALL_AXES
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes.values())
    if need > len(devices):
        raise ValueError(f"mesh {','.join(f'{a}={sizes[a]}' for a in axes)} needs {need} devices but "
                         f"{len(devices)} are available")
    return Mesh(np.asarray(devices[:need], dtype=object).reshape([sizes[a] for a in axes]), axes)


def mesh_sizes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.devices.shape))


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How attention heads and the MLP are laid out over `tp` devices.

    The original model has `num_kv_heads` KV heads with `group` query heads each. The
    tp-ready layout has `kv_groups` distinct KV heads (the extra ones zero), each stored
    `replicas` times, and `q_per_kv` query heads per stored KV head; every device holds
    `physical_kv_heads / tp` KV heads and the query heads that use them.

    Heads that `tp` does not divide are *padded*, and when `tp` exceeds the KV heads, KV heads are
    *replicated* (see `HeadLayout`): the model then runs as an ordinary GQA model with more heads
    whose extra query heads have zero weights and zero output rows, so they change nothing. The
    MLP's hidden size is padded the same way (zero columns of `w_gate`/`w_up`, zero rows of `w_down`).
    """

    tp: int
    num_heads: int
    num_kv_heads: int
    kv_groups: int
    replicas: int
    q_per_kv: int
    intermediate_size: int
    padded_intermediate_size: int
    # A mixture of experts' widths (each expert's, the shared expert's), padded to a multiple of tp.
    moe_intermediate_size: int = 0
    padded_moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    padded_shared_intermediate_size: int = 0

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def physical_kv_heads(self) -> int:
        return self.kv_groups * self.replicas

    @property
    def physical_heads(self) -> int:
        return self.physical_kv_heads * self.q_per_kv

    @property
    def is_identity(self) -> bool:
        return (self.physical_heads == self.num_heads and self.physical_kv_heads == self.num_kv_heads
                and self.padded_intermediate_size == self.intermediate_size
                and self.padded_moe_intermediate_size == self.moe_intermediate_size
                and self.padded_shared_intermediate_size == self.shared_intermediate_size)

    def kv_source(self) -> np.ndarray:
        """Original KV head of each stored KV head, -1 for a zero (padding) head."""
        j = np.arange(self.physical_kv_heads) // self.replicas
        return np.where(j < self.num_kv_heads, j, -1)

    def q_source(self) -> np.ndarray:
        """Original query head of each laid-out query head, -1 for a zero (padding) head."""
        p, s = np.divmod(np.arange(self.physical_heads), self.q_per_kv)
        j, r = np.divmod(p, self.replicas)
        g = r * self.q_per_kv + s
        return np.where((j < self.num_kv_heads) & (g < self.group), j * self.group + g, -1)


def head_layout(config: ModelConfig, tp: int) -> HeadLayout:
    """Pad KV heads up to a multiple of `tp`, or, when `tp` exceeds them, replicate them."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    K, H = config.num_kv_heads, config.num_heads
    G = H // K
    if tp <= K:
        kv_groups, replicas, q_per_kv = math.ceil(K / tp) * tp, 1, G
    else:
        kv_groups = next(k for k in range(K, tp + 1) if tp % k == 0)  # smallest divisor of tp >= K
        replicas = tp // kv_groups
        q_per_kv = math.ceil(G / replicas)
    F = config.intermediate_size
    M, S = config.moe_intermediate_size, config.shared_expert_intermediate_size
    return HeadLayout(tp, H, K, kv_groups, replicas, q_per_kv, F, math.ceil(F / tp) * tp,
                      M, math.ceil(M / tp) * tp, S, math.ceil(S / tp) * tp)


def laid_out_config(config: ModelConfig, layout: HeadLayout) -> ModelConfig:
    """The config of the padded model that the step runs (same outputs as `config`)."""
    if layout.is_identity:
        return config
    return dataclasses.replace(config, num_heads=layout.physical_heads,
                               num_kv_heads=layout.physical_kv_heads,
                               intermediate_size=layout.padded_intermediate_size,
                               moe_intermediate_size=layout.padded_moe_intermediate_size,
                               shared_expert_intermediate_size=layout.padded_shared_intermediate_size)


def device_share(config: ModelConfig, tp: int, ep: int = 1) -> ModelConfig:
    """A config whose layers' weights and KV heads are what one of `tp` (x `ep`) devices holds
    (for memory plans; the embedding is counted whole, an over-estimate by (tp-1)/tp of it)."""
    lay = head_layout(config, tp)
    return dataclasses.replace(config, num_heads=lay.physical_heads // tp,
                               num_kv_heads=lay.physical_kv_heads // tp,
                               intermediate_size=lay.padded_intermediate_size // tp,
                               num_experts=config.num_experts // ep if config.num_experts % ep == 0
                               else config.num_experts,
                               num_experts_per_tok=min(config.num_experts_per_tok, max(1, config.num_experts // ep)),
                               moe_intermediate_size=lay.padded_moe_intermediate_size // tp,
                               shared_expert_intermediate_size=lay.padded_shared_intermediate_size // tp)


def params_per_device(config: ModelConfig, tp: int, ep: int = 1) -> int:
    """Weights one device holds under `tp` and `ep` (after padding; replicated weights counted whole)."""
    return sum(param_bytes_per_device(config, tp, ep, itemsize=1).values())


def param_bytes_per_device(config: ModelConfig, tp: int, ep: int = 1, *, itemsize: int) -> dict[str, int]:
    """Bytes of each weight (by name, all layers) that one device holds under `tp` and `ep`."""
    from jserve.model.llama import param_shapes

    layout = head_layout(config, tp)
    out = {}
    for name, shape in param_shapes(laid_out_config(config, layout)).items():
        spec = tuple(_spec(name, shape, tp, stacked=True, ep=ep if ep > 1 else None))
        split = (tp if "tp" in spec else 1) * (ep if "ep" in spec else 1)
        out[name] = math.prod(shape) // split * itemsize
    return out


def _take_heads(x, axis: int, heads: int, source: np.ndarray):
    """Gather head blocks along `axis` (size heads * head_dim) by `source`; -1 -> zeros."""
    import jax.numpy as jnp

    shape = x.shape
    hd = shape[axis] // heads
    x = x.reshape(*shape[:axis], heads, hd, *shape[axis + 1:])
    idx = jnp.asarray(np.maximum(source, 0))
    out = jnp.take(x, idx, axis=axis)
    mask = jnp.asarray(source >= 0).reshape((1,) * axis + (-1,) + (1,) * (out.ndim - axis - 1))
    out = jnp.where(mask, out, jnp.zeros((), out.dtype))
    return out.reshape(*shape[:axis], len(source) * hd, *shape[axis + 1:])


def _pad_axis(x, axis: int, size: int):
    import jax.numpy as jnp

    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def lay_out_params(config: ModelConfig, layout: HeadLayout, stacked: Mapping[str, Any]) -> dict[str, Any]:
    """Checkpoint (stacked) weights -> the laid-out model's stacked weights (traceable in jit)."""
    if layout.is_identity:
        return dict(stacked)
    q_src, kv_src = layout.q_source(), layout.kv_source()
    H, K, F = layout.num_heads, layout.num_kv_heads, layout.padded_intermediate_size
    # name -> (axis of the head/ffn dimension in the stacked array, kind)
    plan = {"wq": (2, "q"), "bq": (1, "q"), "wk": (2, "kv"), "bk": (1, "kv"), "wv": (2, "kv"),
            "bv": (1, "kv"), "wo": (1, "q"), "w_gate": (2, "f"), "w_up": (2, "f"), "b_gate": (1, "f"),
            "b_up": (1, "f"), "w_down": (1, "f"),
            "we_gate": (3, "m"), "we_up": (3, "m"), "we_down": (2, "m"),
            "ws_gate": (2, "s"), "ws_up": (2, "s"), "ws_down": (1, "s")}
    widths = {"f": F, "m": layout.padded_moe_intermediate_size, "s": layout.padded_shared_intermediate_size}
    out = {}
    for name, x in stacked.items():
        if name not in plan:
            out[name] = x
            continue
        axis, kind = plan[name]
        if kind == "q":
            out[name] = _take_heads(x, axis, H, q_src)
        elif kind == "kv":
            out[name] = _take_heads(x, axis, K, kv_src)
        else:  # zero columns of gate / up and zero rows of down: their products add nothing
            out[name] = _pad_axis(x, axis, widths[kind])
    return out


def _spec(name: str, shape: tuple[int, ...], tp: int, *, stacked: bool, ep: int | None = None):
    """`ep`: the mesh's ep size, None where it has no ep axis (experts then split over tp alone).

    Where every weight and the KV pages live (specs of one layer's arrays; checkpoints stack them
    on a leading layer axis, which is never split):

        weight                 shape                 PartitionSpec        why
        embed                  [vocab, hidden]       (None, "tp")         lookup stays local; the tied
                                                                          head contracts over tp (one all-reduce)
        lm_head                [hidden, vocab]       (None, "tp")         vocabulary-parallel logits
        wq, wk, wv             [hidden, heads*hd]    (None, "tp")         column parallel: heads split
        bq, bk, bv             [heads*hd]            ("tp",)
        wo                     [heads*hd, hidden]    ("tp", None)         row parallel: one all-reduce
        w_gate, w_up           [hidden, ffn]         (None, "tp")         column parallel
        b_gate, b_up           [ffn]                 ("tp",)
        w_down                 [ffn, hidden]         ("tp", None)         row parallel: one all-reduce
        norms, bo, b_down      [hidden] / [hd]       ()                   replicated (tiny)
        k_pages, v_pages       [kv_heads, pages,     ("tp", "dp", None,   KV heads over tp, the page
                                page_size, hd]        None)                pool split into dp groups

    Mixture-of-experts layers (jserve.model.moe):

        w_router               [hidden, experts]     ()                   replicated (small)
        we_gate, we_up         [experts, hidden,     ("ep", None, "tp")   experts split over ep, their
                                moe_ffn]                                  width over tp
        we_down                [experts, moe_ffn,    ("ep", "tp", None)
                                hidden]
        ws_gate, ws_up         [hidden, shared_ffn]  (None, "tp")         the shared expert: as w_gate / w_up
        ws_down                [shared_ffn, hidden]  ("tp", None)
        ws_router              [hidden, 1]           ()

    LoRA slots (jserve.model.lora) split as their base linear: B [slots, rank, out] of q/k/v/gate/up
    on out, A [in, targets, slots, rank] of o/down on in (x @ A all-reduced), the rest replicated.

    Everything else (attention, the KV pages, the activations) is replicated over `ep`: each device
    of an ep group routes all its dp group's tokens, computes the pairs routed to its own experts
    and one psum over (ep, tp) per layer sums them (no expert weight moves). Per device the experts
    take 1 / (ep * tp) of their bytes; the attention's compute is repeated on each ep device.

    So each decoder layer does two all-reduces over `tp` (after `wo` and after `w_down`), and the
    attention kernel runs inside `shard_map` on the device's own heads and pages, never gathered.
    A dimension that `tp` does not divide is replicated instead (the table's rule is kept
    for the rest).
    """
    from jax.sharding import PartitionSpec as P

    rule = PARTITION_RULES.get(name)
    if rule is None:
        raise ValueError(f"no partition rule for weight {name!r}")
    rule = ((None,) if stacked and name in _LAYER_WEIGHTS else ()) + rule
    # A dimension tp does not divide stays replicated (experts' widths are padded to divide).
    rule = tuple(None if a == "tp" and shape[i] % tp else a for i, a in enumerate(rule))
    if ep is None:
        rule = tuple(None if a == "ep" else a for a in rule)
    elif any(a == "ep" and shape[i] % ep for i, a in enumerate(rule)):
        raise ValueError(f"ep={ep} does not divide the {shape[rule.index('ep')]} experts of {name!r}")
    return P(*rule)


_LAYER_WEIGHTS = frozenset(PARTITION_RULES) - {"embed", "lm_head", "final_norm"}


def param_sharding(mesh, name: str, shape: tuple[int, ...], *, stacked: bool = False):
    """NamedSharding of a laid-out weight (`stacked`: with the leading layer axis)."""
    from jax.sharding import NamedSharding

    sizes = mesh_sizes(mesh)
    return NamedSharding(mesh, _spec(name, shape, sizes["tp"], stacked=stacked, ep=sizes.get("ep")))


def kv_sharding(mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh, P(*KV_PAGES_SPEC))


def rows_sharding(mesh):
    """Arrays split by rows over the mesh's `dp` axis (a step's host inputs, `Runner.place`)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh, P("dp"))


def restore_sharding(mesh, name: str, shape: tuple[int, ...], layout: HeadLayout):
    """Where a checkpoint array lands on restore, before it is laid out.

    Weights the layout does not change restore straight into their final sharding. The others
    restore split over all devices along some axis that divides evenly (so no device ever holds
    a full copy) and are laid out by a jitted function afterwards.
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    changed = not layout.is_identity and name in ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "w_gate",
                                                   "w_up", "b_gate", "b_up", "w_down", "we_gate", "we_up",
                                                   "we_down", "ws_gate", "ws_up", "ws_down")
    if not changed:
        return param_sharding(mesh, name, shape, stacked=True)
    n = mesh.devices.size
    for axis in range(len(shape)):
        if shape[axis] % n == 0:
            spec = [None] * len(shape)
            spec[axis] = AXES
            return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())


def place_params(config: ModelConfig, stacked: Mapping[str, Any], mesh, *,
                 layout: str = "list") -> tuple[ModelConfig, dict]:
    """Lay out restored (stacked) weights for `mesh`'s tp and put each in its sharding.

    Runs as one jitted function whose outputs are sharded, so no device holds a whole weight
    that it does not keep. Returns the laid-out config and the model's params in `layout`
    (`jserve.model.model_params`).
    """
    import jax

    from jserve.model import model_params

    check_experts(config, mesh_sizes(mesh))
    head_layout_ = head_layout(config, mesh_sizes(mesh)["tp"])
    new_config = laid_out_config(config, head_layout_)

    def lay_out(p):
        return model_params(new_config, lay_out_params(config, head_layout_, p), layout)

    mesh_devices = set(mesh.devices.flat)
    stacked = {k: v if isinstance(v, jax.Array) and set(v.sharding.device_set) == mesh_devices
               else jax.device_put(v, restore_sharding(mesh, k, v.shape, head_layout_)) for k, v in stacked.items()}
    shapes = jax.eval_shape(lay_out, dict(stacked))
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, v: param_sharding(mesh, str(path[-1].key), v.shape,
                                       stacked=layout == "stacked" and str(path[0].key) == "layers"), shapes)
    return new_config, jax.jit(lay_out, out_shardings=shardings)(dict(stacked))


def check_experts(config: ModelConfig, sizes: Mapping[str, int]) -> None:
    """Refuse an ep axis the model cannot use: ep > 1 for a dense model, or one that does not
    divide the experts."""
    ep = sizes.get("ep", 1)
    if ep > 1 and not config.moe:
        raise ValueError(f"mesh axis ep={ep} splits a mixture of experts' experts; this {config.architecture} "
                         f"model is dense: leave ep out (or use dp / tp)")
    if config.moe and config.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the model's {config.num_experts} experts")


def describe(config: ModelConfig, mesh_spec: Any) -> str:
    """One line: how the heads and MLP are laid out for this mesh (for logs and `jserve plan`)."""
    sizes = parse_mesh(mesh_spec) if not hasattr(mesh_spec, "axis_names") else mesh_sizes(mesh_spec)
    lay = head_layout(config, sizes["tp"])
    ep = sizes.get("ep", 1)
    experts = ""
    if config.moe:
        per = config.num_experts // ep if config.num_experts % ep == 0 else config.num_experts
        width = lay.padded_moe_intermediate_size
        experts = f"; {per} of {config.num_experts} experts per device, expert ffn {width // sizes['tp']} of {width}"
    axes = f"dp={sizes['dp']}" + (f" ep={ep}" if "ep" in sizes else "") + f" tp={sizes['tp']}"
    return (f"{axes}: {lay.physical_heads} query heads "
            f"({config.num_heads} real), {lay.physical_kv_heads} KV heads ({config.num_kv_heads} real, "
            f"x{lay.replicas} replicas), ffn {lay.padded_intermediate_size} ({config.intermediate_size} real); "
            f"per device {lay.physical_heads // sizes['tp']} query / {lay.physical_kv_heads // sizes['tp']} KV heads"
            + experts)
