"""Multi-host runs through JAX's own runtime (`jax.distributed`), no RPC layer of ours.

Every process runs the same command. Process 0 loads the model, schedules and serves; each
step it broadcasts the step's host inputs with JAX's collectives (`StepBroadcast.lead`), and the
other processes, in `StepBroadcast.follow()`, run the same compiled step on their devices (SPMD).
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_multihost_args(p: argparse.ArgumentParser) -> None:
    """The flags of `from_args`, for the commands that run the engine."""
    g = p.add_argument_group("multi-host (jax.distributed)")
    g.add_argument("--distributed", action="store_true",
                   help="join a multi-process run: jax.distributed.initialize() (auto-detected on a TPU "
                        "slice, or from the flags below); process 0 serves, the others follow its steps")
    g.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0's coordinator")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> int:
    """Join the run (auto-detected on Cloud TPU slices when the arguments are None).

    On CPU, cross-process collectives go through gloo. Returns this process's index.
    """
    import jax

    given = [coordinator_address is None, num_processes is None, process_id is None]
    if any(given) and not all(given):
        raise ValueError("give all of --coordinator-address, --num-processes and --process-id, or none "
                         "(auto-detection on a TPU slice)")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    if process_id is not None and not 0 <= process_id < (num_processes or 1):
        raise ValueError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    logger.info("process %d of %d, %d local / %d global devices", jax.process_index(),
                   jax.process_count(), jax.local_device_count(), jax.device_count())
    return jax.process_index()


def from_args(args: argparse.Namespace) -> bool:
    """Initialize when `--distributed` was given; True if this process leads (serves)."""
    if not getattr(args, "distributed", False):
        for flag in ("coordinator_address", "num_processes", "process_id"):
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --distributed")
        return True
    index = initialize(args.coordinator_address, args.num_processes, args.process_id)
    if getattr(args, "mesh", None) is None:
        import jax

        args.mesh = f"tp={jax.device_count()}"  # default: tensor parallel over every device
    return index == 0


def follow(llm) -> int:
    """A follower's whole job: run process 0's steps until it stops; returns the steps run."""
    steps = llm.engine.runner.follow()
    logger.info("process 0 stopped the run after %d steps", steps)
    return steps


# What process 0 broadcasts before each step: [op, kind, batch, tokens, masked] (`StepBroadcast.lead`).
STEP_OP, STOP_OP = 0, 1
STEP_KINDS = ("decode", "mixed")


def broadcast(header, tree=None):
    """Process 0's `header` (and then `tree`) to every process, through JAX's own collectives.

    Followers pass a zero header and a template tree of the right shapes; they get process 0's.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if tree is None:
        return np.asarray(multihost_utils.broadcast_one_to_all(header))
    if header is not None:  # process 0: first the header, then the inputs
        multihost_utils.broadcast_one_to_all(header)
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


class StepBroadcast:
    """A runner's steps across processes: process 0 leads (broadcasts each call's inputs and
    runs it), the others follow (receive and run the same call)."""

    def __init__(self, runner):
        self.runner = runner

    def lead(self, kind: str, B: int, T: int, inputs, constraints):
        """On process 0: send a call's header and inputs, then run it. The header says whether a
        grammar bitmask follows: only a constrained step sends one (filled before the broadcast,
        so before the forward: no overlap across hosts)."""
        import dataclasses

        import jax
        import numpy as np

        runner = self.runner
        if jax.process_index() != 0:
            raise RuntimeError("only process 0 drives the steps; the others call follow()")
        header = np.asarray([STEP_OP, STEP_KINDS.index(kind), B, T, int(bool(constraints))], np.int32)
        if constraints:
            inputs = dataclasses.replace(inputs, mask=runner.masks.host(B, constraints))
        return runner.device_step(broadcast(header, inputs))

    def follow(self) -> int:
        """On processes other than 0: run the steps process 0 broadcasts until it stops them;
        returns the number of steps run."""
        import jax
        import numpy as np

        from jserve.runtime import step_rows
        from jserve.runtime.steps import StepInputs

        runner = self.runner
        steps = 0
        while True:
            op, kind, B, T, masked = (int(x) for x in broadcast(np.zeros(5, np.int32)))
            if op == STOP_OP:
                return steps
            if STEP_KINDS[kind] == "mixed":
                packed = step_rows.pack_ragged([[]] * runner.dp, B // runner.dp, T, max_pages=runner.max_pages,
                                               page_size=runner.page_size, hybrid=runner.hybrid)
            else:
                packed = runner.pack([None] * B, B, T)
            template = StepInputs.of(packed, *runner.sampling_inputs([], B), runner.masks.ones(B) if masked else None,
                                     None if runner.lora is None else np.zeros_like(packed[0]))
            jax.block_until_ready(runner.device_step(broadcast(None, template)))
            steps += 1

    def stop(self) -> None:
        """On process 0 at shutdown: release the processes in `follow()`."""
        import jax
        import numpy as np

        if self.runner.multiprocess and jax.process_index() == 0:
            broadcast(np.asarray([STOP_OP, 0, 0, 0, 0], np.int32))
