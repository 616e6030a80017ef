"""What the per-architecture tests share: the tiny checkpoints under tests/data/arch, a tokenizer
that spells token ids, and running an engine to the end."""

from __future__ import annotations

import jax.numpy as jnp

from conftest import DATA


class IdTokenizer:
    """Just enough tokenizer for the engine's outputs: text is the token ids, space-separated."""

    eos_token_ids = ()

    def decode(self, ids):
        return " ".join(map(str, ids))

    def detokenizer(self, prompt, skip_special_tokens=True):
        class Detok:
            def add(self, ids):
                return "".join(f" {i}" for i in ids)

            def flush(self):
                return ""

        return Detok()


def load_arch(arch: str):
    """The tiny checkpoint tests/data/arch/`arch`: its config and its params on the device."""
    from jserve.model.checkpoint import read_params

    config, params = read_params(DATA / "arch" / arch)
    return config, {k: jnp.asarray(v) for k, v in params.items()}


def finish(engine, after_step=None) -> dict:
    """Step `engine` until every request is done (calling `after_step()` after each step, if
    given); request id -> its final output."""
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        if after_step is not None:
            after_step()
    return outs


def widened(arch: str, vocab_size: int):
    """A tiny checkpoint's (config, params) with its embedding padded with random rows to
    `vocab_size` ids, for a tokenizer larger than its vocabulary."""
    import dataclasses

    import numpy as np

    from jserve.model.checkpoint import read_params

    config, params = read_params(DATA / "arch" / arch)
    embed = np.asarray(params["embed"])
    extra = np.random.default_rng(0).normal(0, embed.std(), (vocab_size - embed.shape[0], embed.shape[1]))
    params = {**params, "embed": np.concatenate([embed, extra.astype(embed.dtype)])}
    return dataclasses.replace(config, vocab_size=vocab_size), {k: jnp.asarray(v) for k, v in params.items()}
