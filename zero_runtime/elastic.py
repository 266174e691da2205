"""The batch of a job whose worker count changes: the global batch is kept by raising
gradient accumulation, so the loss curve continues across a resize.

``zero-runtime launch --nproc N --min-nproc M`` may run a job on fewer workers than N
after a rank keeps failing, and on N again when asked (docs/multiworker/restarts.md, "A shrinking
and growing cluster"). It tells each worker the current world size ``w``
(``ZERO_RUNTIME_WORLD_SIZE``) and N (``ZERO_RUNTIME_MAX_WORLD_SIZE``). DeepSpeed's
elasticity rule (``deepspeed/elasticity/elasticity.py``): the train batch stays fixed,
``train_batch = micro_batch_per_worker x gradient_accumulation_steps x world_size``, with
the per-worker micro-batch fixed too (a worker's memory does not change), so only the
accumulation changes: ``gradient_accumulation_steps(w) = base x N / w``. The launcher
runs only world sizes that divide N (:func:`world_sizes`), so that is a whole number.

A script reads its plan once, before it builds the strategy::

    plan = zero_runtime.elastic.batch_plan(global_batch=64)
    config["gradient_accumulation_steps"] = plan.gradient_accumulation_steps
    strategy = ZeroInfinityStrategy(config)
    model.fit(x, y, batch_size=plan.batch_size, ...)

``fit``'s ``batch_size`` is the batch of one micro-step across every worker
(``micro_batch_per_worker x w``); ``plan.gradient_accumulation_steps`` micro-steps make
one optimizer step of ``global_batch`` examples, the same examples in the same order at
any ``w``. Checkpoints count optimizer steps, so a resize resumes at the same example:
``ZeroBackupAndRestore`` converts its batch position and the restore rescales the
optimizer's micro-step counter (docs/checkpoint.md).
"""

from __future__ import annotations

import dataclasses
import os

#: Environment variables ``zero-runtime launch`` sets for every worker.
WORLD_SIZE_ENV = "ZERO_RUNTIME_WORLD_SIZE"
MAX_WORLD_SIZE_ENV = "ZERO_RUNTIME_MAX_WORLD_SIZE"


def world_sizes(nproc: int, min_nproc: int) -> list[int]:
    """The world sizes a job of ``nproc`` workers may run at, largest first: the
    divisors of ``nproc`` that are ``>= min_nproc``.

    Raises:
        ValueError: ``nproc`` < 1, or ``min_nproc`` not in ``1..nproc``.
    """
    if nproc < 1 or not 1 <= min_nproc <= nproc:
        raise ValueError(f"need 1 <= min_nproc <= nproc, got min_nproc={min_nproc}, nproc={nproc}")
    return [w for w in range(nproc, min_nproc - 1, -1) if nproc % w == 0]


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """One world size's batch under a fixed global batch.

    Attributes:
        global_batch: examples per optimizer step (fixed across world sizes).
        world_size: workers now (``w``).
        max_world_size: workers the job was launched with (``N``).
        micro_batch_per_worker: examples one worker computes per micro-step (fixed).
        gradient_accumulation_steps: micro-steps per optimizer step at ``w``.
        batch_size: examples of one micro-step across every worker: ``fit``'s
            ``batch_size`` (``micro_batch_per_worker x w``).
    """

    global_batch: int
    world_size: int
    max_world_size: int
    micro_batch_per_worker: int
    gradient_accumulation_steps: int
    batch_size: int


def batch_plan(
    global_batch: int,
    gradient_accumulation_steps: int = 1,
    world_size: int | None = None,
    max_world_size: int | None = None,
) -> BatchPlan:
    """The batch and accumulation that keep ``global_batch`` at this world size.

    Args:
        global_batch: examples per optimizer step (int >= 1).
        gradient_accumulation_steps: accumulation at the full world size (int >= 1,
            default 1).
        world_size: workers now; default ``ZERO_RUNTIME_WORLD_SIZE`` (1 when unset).
        max_world_size: workers at full size; default ``ZERO_RUNTIME_MAX_WORLD_SIZE``
            (``world_size`` when unset: a job not launched elastically).

    Returns:
        The :class:`BatchPlan`: ``gradient_accumulation_steps x N / w`` micro-steps of
        ``global_batch / (gradient_accumulation_steps x N / w)`` examples.

    Raises:
        ValueError: a value < 1, ``world_size`` > ``max_world_size``, ``world_size`` not
            a divisor of ``max_world_size``, or ``global_batch`` not a multiple of
            ``max_world_size x gradient_accumulation_steps`` (the per-worker micro-batch
            must be whole); the message names the numbers.
    """
    w = int(os.environ.get(WORLD_SIZE_ENV, "1")) if world_size is None else int(world_size)
    n = (
        int(os.environ.get(MAX_WORLD_SIZE_ENV, str(w)))
        if max_world_size is None
        else max_world_size
    )
    base = int(gradient_accumulation_steps)
    if min(global_batch, base, w, n) < 1 or w > n:
        raise ValueError(
            f"batch_plan: need global_batch, gradient_accumulation_steps >= 1 and "
            f"1 <= world_size <= max_world_size, got {global_batch}, {base}, {w}, {n}"
        )
    if n % w:
        raise ValueError(
            f"batch_plan: world size {w} does not divide the full size {n}, so the "
            "accumulation that keeps the global batch is not a whole number (zero-runtime "
            "launch only runs divisors of --nproc)"
        )
    if global_batch % (n * base):
        raise ValueError(
            f"batch_plan: global batch {global_batch} is not a multiple of {n} workers x "
            f"{base} accumulation steps (each worker's micro-batch must be whole)"
        )
    micro = global_batch // (n * base)
    steps = base * n // w
    return BatchPlan(global_batch, w, n, micro, steps, micro * w)
