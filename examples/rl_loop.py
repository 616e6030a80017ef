"""A toy reinforcement-learning loop: jserve serves the rollouts, plain JAX + optax trains.

Each iteration:
  1. rollout  `llm.generate` samples completions (with each token's logprob) for prompts written here;
  2. reward   1 if the answer says the target word ("blue"), minus a penalty per token (shorter is better);
  3. sleep    `llm.sleep(level=2)`: the engine frees its KV pages and drops its weights (new ones come next);
  4. update   one REINFORCE step, loss = -advantage * sum of the completion's logprobs, on the trainer's
              own forward pass (the same Flax NNX model, dense attention: `forward_logits`);
  5. sync     `llm.update_weights(params)`: the trainer's tree, in jserve's names, served from now on;
  6. wake     `llm.wake_up()`: the KV pages back; nothing recompiles.

    python examples/rl_loop.py [--model M] [--iterations 3] [--batch 4] [--max-tokens 16]

Prints per iteration the reward, the gap between the engine's and the trainer's logprobs of the sampled
tokens (same weights: rounding only), and the seconds each phase took.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jserve import LLM, SamplingParams
from jserve.eval.serving_vs_forward import forward_logits
from jserve.model.checkpoint import load_checkpoint

QUESTIONS = ["Name a color.", "What color is the sky?", "Pick a color for a car.", "What is your favorite color?"]
PROBE = "The sky is"  # a fixed prompt whose next-token logprobs show the weights changing


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint or name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="completions per iteration")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--word", default="blue", help="the word the reward asks for")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def prompts(llm: LLM, batch: int) -> list[list[int]]:
    """`batch` chat prompts (token ids), cycling through QUESTIONS."""
    tok = llm.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
             for i in range(batch)]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def reward(text: str, num_tokens: int, word: str, max_tokens: int) -> float:
    return float(word in text.lower()) - 0.5 * num_tokens / max_tokens


def pack(rollouts: list[tuple[list[int], list[int]]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, length], mask [B, length - 1]): mask[b, j] = 1 where position j predicts a completion token."""
    tokens = np.zeros((len(rollouts), length), np.int32)
    mask = np.zeros((len(rollouts), length - 1), np.float32)
    for b, (prompt, completion) in enumerate(rollouts):
        ids = prompt + completion
        tokens[b, :len(ids)] = ids
        mask[b, len(prompt) - 1:len(ids) - 1] = 1.0
    return tokens, mask


def token_logprobs(config, params, tokens):
    """Log p(tokens[:, j + 1] | tokens[:, :j + 1]) [B, T - 1] under the trainer's forward pass."""
    logprobs = jax.nn.log_softmax(forward_logits(config, params, tokens)[:, :-1], axis=-1)
    return jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]


def make_step(config, optimizer):
    def loss_fn(params, tokens, mask, advantages):
        logprobs = token_logprobs(config, params, tokens)
        return -jnp.sum(advantages[:, None] * logprobs * mask) / jnp.maximum(jnp.sum(mask), 1.0), logprobs

    @jax.jit
    def step(params, opt_state, tokens, mask, advantages):
        (loss, logprobs), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, mask, advantages)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, logprobs

    return step


def probe(llm: LLM, ids: list[int]) -> dict[int, float]:
    """The engine's top-5 next-token logprobs after `ids` (one greedy token: no extra compilation)."""
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


def run(args: argparse.Namespace, llm: LLM | None = None) -> dict:
    """The loop; returns the history, the trainer's final params, the LLM and the probe's logprobs."""
    llm = llm or LLM(args.model, dtype="float32", max_num_seqs=args.batch, max_model_len=256)
    _, params, _ = load_checkpoint(llm.path, dtype=llm.dtype)  # the trainer's copy, in jserve's names
    params = {k: jnp.asarray(v) for k, v in params.items()}
    optimizer = optax.adam(args.lr)
    opt_state, step = optimizer.init(params), make_step(llm.config, optimizer)
    batch = prompts(llm, args.batch)
    length = -(-(max(map(len, batch)) + args.max_tokens) // 32) * 32  # one compiled shape for every iteration
    probe_ids = llm.tokenizer.encode(PROBE)
    result = {"probe_before": probe(llm, probe_ids), "history": []}
    for it in range(args.iterations):
        t0 = time.perf_counter()
        sampling = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, logprobs=0,
                                   seed=args.seed + it * args.batch + b) for b in range(args.batch)]
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in batch], sampling)]
        t1 = time.perf_counter()
        rewards = np.array([reward(o.text, len(o.token_ids), args.word, args.max_tokens) for o in outs], np.float32)
        served = np.concatenate([[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs])
        tokens, mask = pack([(p, o.token_ids) for p, o in zip(batch, outs)], length)
        llm.sleep(level=2)  # the weights are replaced next: no host copy of them
        t2 = time.perf_counter()
        params, opt_state, loss, trained = step(params, opt_state, tokens, mask, rewards - rewards.mean())
        trained = np.asarray(trained)[mask > 0]  # the trainer's logprobs of the sampled tokens, before the step
        t3 = time.perf_counter()
        # A copy: the engine keeps arrays already on its device as they are (no copy), and the next
        # sleep(level=2) would free them under the trainer.
        sync = llm.update_weights(jax.tree.map(jnp.copy, params), donate=True)
        t4 = time.perf_counter()
        llm.wake_up()
        t5 = time.perf_counter()
        row = {"iteration": it, "reward": float(rewards.mean()), "loss": float(loss),
               "logprob_gap": float(np.abs(trained - served).max()), "rollout_s": t1 - t0, "update_s": t3 - t2,
               "sync_s": t4 - t3, "sleep_wake_s": (t2 - t1) + (t5 - t4), "sync": sync}
        result["history"].append(row)
        print(f"iter {it}: reward {row['reward']:+.3f}  loss {row['loss']:+.4f}  "
              f"|engine - trainer| logprob max {row['logprob_gap']:.2e}  rollout {row['rollout_s']:.2f}s  "
              f"update {row['update_s']:.2f}s  weight sync {row['sync_s']:.2f}s  sleep+wake {row['sleep_wake_s']:.2f}s",
              flush=True)
    result["compilations_after_warmup"] = llm.stats()["compilations_after_warmup"]
    result.update(probe_after=probe(llm, probe_ids), params=params, llm=llm, probe_ids=probe_ids)
    print(f"engine compilations after warm-up: {result['compilations_after_warmup']}")
    return result


if __name__ == "__main__":
    run(parse_args())
