"""examples/rl_loop.py, two iterations on the default model: the engine serves the trainer's updated
weights (its next-token logprobs move, and equal the trainer's forward pass on the final params),
its rollout logprobs match the trainer's, and nothing compiles after warm-up."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

EXAMPLE = Path(__file__).parents[1] / "examples" / "rl_loop.py"


def _load():
    spec = importlib.util.spec_from_file_location("rl_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rl_loop_updates_the_served_weights_without_compiling(smollm2_checkpoint):
    rl = _load()
    result = rl.run(rl.parse_args(["--model", str(smollm2_checkpoint), "--iterations", "2", "--batch", "2",
                                   "--max-tokens", "8", "--lr", "1e-4"]))
    llm = result["llm"]
    try:
        assert [row["iteration"] for row in result["history"]] == [0, 1]
        for row in result["history"]:
            assert row["logprob_gap"] < 1e-3, row  # the engine's and the trainer's logprobs, same weights
            assert min(row["rollout_s"], row["update_s"], row["sync_s"], row["sleep_wake_s"]) > 0
        assert result["compilations_after_warmup"] == 0
        before, after = result["probe_before"], result["probe_after"]
        moved = max(abs(before[t] - after[t]) for t in set(before) & set(after))
        # The trainer's final params, by its own forward: what the engine now serves.
        ids = jnp.asarray([result["probe_ids"]], jnp.int32)
        logits = jax.jit(rl.forward_logits, static_argnums=0)(llm.config, result["params"], ids)
        trainer = np.asarray(jax.nn.log_softmax(logits[0, -1]))
        gap = max(abs(after[t] - trainer[t]) for t in after)
        print(f"probe moved {moved:.2e}, engine vs trainer {gap:.2e}")
        assert gap < 1e-3 < moved, (gap, moved)
    finally:
        llm.close()
