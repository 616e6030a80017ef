"""The Hugging Face reference computations behind tests/data/arch/'s goldens: the fixed input ids,
a forward's logits, greedy tokens (checked against a cache-free loop), and the probes the self-checks
use (rotary positions seen, a kept-cache loop, logits under a changed config, MoE routing)."""

from __future__ import annotations

import numpy as np
import torch
from arch_cases import BATCH, INPUT_SEED, NEW_TOKENS, SEQ, VOCAB, variant_model
from transformers import GenerationConfig


def make_input_ids() -> np.ndarray:
    rng = np.random.default_rng(INPUT_SEED)
    return rng.integers(0, VOCAB, size=(BATCH, SEQ), dtype=np.int64).astype(np.int32)


@torch.no_grad()
def forward_logits(model, ids: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(ids.astype(np.int64))
    out = model(input_ids=t, attention_mask=torch.ones_like(t), use_cache=False)
    return out.logits.float().numpy()


@torch.no_grad()
def greedy(model, prompt: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(prompt.astype(np.int64))
    # eos disabled: generate() fills None fields of a passed GenerationConfig
    # from model.generation_config (which carries the config's eos id), so clear
    # it there too. No min_new_tokens: that would mask the eos logit instead.
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    gc = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), generation_config=gc)
    new = out[:, t.shape[1]:].numpy().astype(np.int32)
    assert new.shape == (1, NEW_TOKENS), new.shape
    # Cross-check against a cache-free argmax loop.
    seq = t.clone()
    for _ in range(NEW_TOKENS):
        logits = model(input_ids=seq, attention_mask=torch.ones_like(seq), use_cache=False).logits
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    loop = seq[:, t.shape[1]:].numpy().astype(np.int32)
    assert np.array_equal(new, loop), (name_of(model), new, loop)
    return new


def rotary_positions(model, prompt: np.ndarray) -> list[list[int]]:
    """The position_ids of each rotary-embedding call during `greedy(model, prompt)`."""
    seen = []
    hook = model.model.rotary_emb.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append(kwargs["position_ids"][0].tolist()), with_kwargs=True)
    greedy(model, prompt)
    hook.remove()
    return seen


@torch.no_grad()
def cached_loop(model, prompt: np.ndarray) -> np.ndarray:
    """Greedy tokens by single-token steps over one DynamicCache that is never dropped."""
    from transformers import DynamicCache

    t = torch.from_numpy(prompt.astype(np.int64))
    out = model(input_ids=t, use_cache=True, cache=DynamicCache(config=model.config))
    new = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for i in range(NEW_TOKENS - 1):
        out = model(input_ids=new[-1], position_ids=torch.tensor([[t.shape[1] + i]]), use_cache=True,
                    cache=out.cache)
        new.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(new, dim=1).numpy().astype(np.int32)


def name_of(model) -> str:
    return type(model).__name__


def variant_logits(name: str, model, ids: np.ndarray, **cfg_changes) -> np.ndarray:
    """Logits of the same weights under a modified config."""
    return forward_logits(variant_model(name, model, **cfg_changes), ids)


@torch.no_grad()
def routing(model, ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each MoE layer's (router probabilities [tokens, experts], chosen experts [tokens, k]) on `ids`."""
    got = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: got.append(out))
             for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    forward_logits(model, ids)
    for h in hooks:
        h.remove()
    return [(torch.softmax(lg.float(), -1).numpy(), idx.numpy()) for lg, _, idx in got]


def shorter_logits(model, ids: np.ndarray) -> np.ndarray:
    """Logits of the first original_max_position_embeddings tokens alone (LongRoPE's short factors)."""
    return forward_logits(model, ids[:, :model.config.rope_parameters["original_max_position_embeddings"]])
