"""Sleep and wake (`LLM.sleep` / `wake_up`, vLLM's names): the weights' and pages' device bytes are
freed (counted from the backend's live arrays), and waking serves the same tokens with no
compilation; level 2 drops the weights until new ones or a reload bring them back."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from test_update_weights import SETTINGS, _tokens, checkpoints  # noqa: F401 - the fixture

# The first test checks that waking compiles nothing after warm-up: it keeps SETTINGS (warmed up). The
# others assert nothing about compilation: each compiles only the shapes it runs, not every bucket.
LAZY = {**SETTINGS, "warmup": False}


def _on_device(x) -> bool:
    return not x.is_deleted() and getattr(x.sharding, "memory_kind", None) not in ("pinned_host", "unpinned_host")


def _bytes(arrays) -> int:
    """Device bytes of the distinct, undeleted arrays among `arrays`."""
    return sum({id(x): x.nbytes for x in arrays if _on_device(x)}.values())


def _check_freed(llm, sleep) -> None:
    """`sleep()` frees the served weights' and pages' device bytes and makes no device copy of
    them. Counted over the arrays alive before it (held here, so their ids stay theirs): other
    tests' engines in this process may allocate meanwhile (their background compiles)."""
    served = jax.tree.leaves((llm.runner.params, llm.runner.kv))
    alive = jax.live_arrays()
    awake, ids, freed = _bytes(alive), {id(x) for x in alive}, _bytes(served)
    sleep()
    assert all(x.is_deleted() for x in served)
    assert _bytes(alive) <= awake - freed + 1024  # (a step's small inputs come and go)
    shapes = {(x.shape, x.dtype) for x in served if x.nbytes > 1024}
    assert not [x for x in jax.live_arrays() if id(x) not in ids and _on_device(x) and (x.shape, x.dtype) in shapes]


@pytest.mark.parametrize("backend", ["native", "xla"])
def test_sleep_frees_the_weights_and_pages_and_wake_serves_again(checkpoints, backend):  # noqa: F811
    from jserve import LLM

    base, _, perturbed = checkpoints
    llm = LLM(str(base), backend=backend, **SETTINGS)
    before = _tokens(llm)
    _check_freed(llm, lambda: llm.sleep(level=1))
    assert llm.is_sleeping()
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([1, 2, 3])
    llm.wake_up()
    assert not llm.is_sleeping() and _tokens(llm) == before
    # level 2: the weights are dropped; wake_up reloads the checkpoint
    _check_freed(llm, lambda: llm.sleep(level=2))
    llm.wake_up()
    assert _tokens(llm) == before
    # level 2, then new weights while asleep: they are what wakes up
    llm.sleep(level=2)
    llm.update_weights(perturbed)
    assert llm.is_sleeping()
    llm.wake_up(["kv_cache"])
    assert _tokens(llm) != before
    assert llm.stats()["compilations_after_warmup"] == 0
    llm.close()


def test_wake_up_in_steps_and_bad_arguments(checkpoints):  # noqa: F811
    from jserve import LLM

    llm = LLM(str(checkpoints[0]), **LAZY)
    before = _tokens(llm)
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(level=3)
    llm.sleep(level=1)
    llm.wake_up(["weights"])  # the weights first (a trainer's memory is still in use), then the pages
    assert llm.is_sleeping()
    with pytest.raises(ValueError, match="tags must be among"):
        llm.wake_up(["pages"])
    llm.wake_up(["kv_cache"])
    assert _tokens(llm) == before
    llm.sleep(level=2)
    with pytest.raises(ValueError, match="level 2 dropped the weights"):
        llm.engine.wake_up()
    llm.close()


def test_prefix_cache_is_dropped_by_an_update(checkpoints):  # noqa: F811
    from jserve import LLM

    base, perturbed_dir, perturbed = checkpoints
    llm = LLM(str(base), **LAZY)
    _tokens(llm)
    _tokens(llm)
    assert llm.stats()["prefix_cache_hit_tokens"] > 0 and llm.stats()["pages_cached"] > 0
    llm.update_weights(perturbed)
    assert llm.stats()["pages_cached"] == 0
    hits = llm.stats()["prefix_cache_hit_tokens"]
    got = _tokens(llm)
    assert llm.stats()["prefix_cache_hit_tokens"] == hits  # nothing computed by the old weights is reused
    fresh = LLM(str(perturbed_dir), **LAZY)
    assert got == _tokens(fresh)
    fresh.close()
    llm.close()
    assert np.isfinite(hits)


@pytest.mark.parametrize("backend", ["native", "xla"])
def test_the_callers_arrays_outlive_the_engines_updates_and_sleep(checkpoints, backend):  # noqa: F811
    """Arrays given without donation stay the caller's: the engine serves copies of the ones it
    could have shared, and frees only those (the next update, sleep at either level)."""
    import jax.numpy as jnp

    from jserve import LLM

    base, perturbed_dir, perturbed = checkpoints
    llm = LLM(str(base), backend=backend, **LAZY)
    mine = {k: jnp.asarray(v, jnp.float32) for k, v in perturbed.items()}  # on the serving device, served dtype
    llm.update_weights(mine)
    got = _tokens(llm)
    llm.update_weights({k: jnp.asarray(v, jnp.float32) for k, v in perturbed.items()})
    llm.sleep(level=1)
    llm.wake_up()
    llm.sleep(level=2)
    assert not [k for k, x in mine.items() if x.is_deleted()]
    for k, v in perturbed.items():
        np.testing.assert_array_equal(np.asarray(mine[k]), np.asarray(v, np.float32), err_msg=k)
    llm.update_weights(mine)
    llm.wake_up(["kv_cache"])
    assert _tokens(llm) == got
    llm.close()
