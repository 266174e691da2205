"""Verified OOM advice: each candidate change replayed on the failed step's figures.

A post-mortem (:mod:`zero_runtime.oom`, built by
:mod:`zero_runtime.runtime.postmortem`) offers single config changes. Each is *replayed*
here on what the runtime recorded: the checked figure of the failed
tier in the last steps (the device tier's boundary use and its in-step allocator peak,
``peak_bytes``), the holders by kind, the gathered units of stage 3 per live replica, and
the estimator's per-tier model-state bytes (:mod:`zero_runtime.estimator`, SC20 section
5.1 and SC21 section 3) for the current and the changed config. A candidate is labelled

- ``"fits"`` only when its predicted bytes on the failed tier plus a margin are within
  the tier's capacity, and every tier it moves bytes to has the room (host free memory,
  NVMe free space) with the same margin;
- ``"does not fit"`` when a floor no change of this kind removes is over the capacity
  (e.g. stage 3's largest gathered unit on every live replica), or the target tier has
  no room;
- ``"may fit"`` otherwise, with the missing bytes (predicted + margin - capacity).

Candidates that cannot change anything are not offered (``max_live_parameters`` at or
above the gathered elements; a stage change the strategy does not implement).

Margins: :data:`MARGIN_ACCOUNTED` of the capacity when the checked figure is the runtime's
own deterministic accounting, :data:`MARGIN_ALLOCATOR` when it is an allocator's reading
(its boundary use varies from step to step: buffers, fragmentation), and never less than
the spread of the recorded figures over the last steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from zero_runtime import estimator
from zero_runtime.oom_report import fmt_bytes

#: Fraction of the capacity kept free when the checked figure is the runtime's accounting.
MARGIN_ACCOUNTED = 0.05
#: Fraction kept free when the checked figure is an allocator's reading.
MARGIN_ALLOCATOR = 0.25
#: Fraction of headroom a moved state needs on its target tier (host memory, NVMe).
MARGIN_TARGET = 0.25

SPEED_COSTS = ("none", "low", "medium", "high")
VERDICTS = ("fits", "may fit", "does not fit")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One stage-3 wrapping unit (a Keras layer whose weights are gathered together).

    Attributes:
        name: the layer's name, e.g. ``"embedding"``.
        gathered_bytes: bytes of its gathered (non-persistent) parameters on one replica,
            float32, rounded up to pages per variable.
        elements: its non-persistent parameter elements.
    """

    name: str
    gathered_bytes: int
    elements: int


@dataclasses.dataclass(frozen=True)
class Stage3Plan:
    """What ZeRO-Infinity (stage 3, parameters and optimizer states offloaded to host
    memory) would hold for a model trained at stages 0-2: the estimator's figures
    (:func:`zero_runtime.estimator.estimate_for_model`, page-rounded) of one replica.

    Attributes:
        device_bytes: what the paged pool's device tier must hold within a step, bytes:
            the persistent (small, replicated) parameters plus the working set, the
            largest unit's gathered parameters and the next unit's prefetch (SC20
            section 5.3; ZeRO-Infinity, SC21 section 5). The pool keeps its device tier
            within the budget by moving other gathered buffers to host memory, so this
            is what the budget must hold per replica.
        host_bytes: model states the change puts in host memory, bytes.
        largest_unit: the name of the largest unit (a top-level layer).
    """

    device_bytes: int
    host_bytes: int
    largest_unit: str


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What the runtime recorded about the failed step, for the replay.

    Attributes:
        allocator: True when the device tier's checked figure is an allocator's reading
            (TensorFlow's BFC statistics), False when it is the runtime's accounting.
        recent_used: the failed tier's checked bytes in the last steps (oldest first,
            the failed step last).
        recent_peaks: the failed tier's in-step peaks (the record's ``peak_bytes``).
        num_params: Ψ, trainable elements of one replica (None: unknown).
        local_replicas: replicas in this process (each holds its own copy of what is
            replicated on the device tier, and gathers its own units at stage 3).
        units: stage 3's units, any order (empty at stages 0-2).
        shard_bytes: stage 3, bytes of one replica's parameter shards, rounded up to pages
            per variable (optimizer slots take as many each).
        persistent_bytes: stage 3, bytes of one replica's persistent (replicated)
            parameters on the device.
        optimizer: the optimizer kind for the estimator ('adam', 'sgd', ...).
        in_step: True when the failure happened inside a step (an allocator or pool
            OOM); the need then includes the step's transient bytes.
        stage3_plan: at stages 0-2, the estimator's figures for ZeRO-Infinity on this
            model (:class:`Stage3Plan`); None when the model was not known.
    """

    allocator: bool = False
    recent_used: tuple[int, ...] = ()
    recent_peaks: tuple[int, ...] = ()
    num_params: int | None = None
    local_replicas: int = 1
    units: tuple[Unit, ...] = ()
    shard_bytes: int = 0
    persistent_bytes: int = 0
    optimizer: str = "adam"
    in_step: bool = False
    stage3_plan: Stage3Plan | None = None

    @property
    def largest_unit(self) -> Unit | None:
        """The unit with the most gathered bytes, or None."""
        return max(self.units, key=lambda u: u.gathered_bytes, default=None)


def _round_up(n: float, quantum: int) -> int:
    return int(-(-int(math.ceil(n)) // quantum) * quantum)


class _Replay:
    """The shared state of one ``advise`` call (see :func:`advise`)."""

    def __init__(self, tier, required, cap, holders, config, n, physical, free, ev):
        self.tier, self.cap, self.config, self.n = tier, cap, config, n
        self.physical, self.free, self.ev = physical, free, ev
        self.holders = {k: int(v) for k, v in holders.items()}
        attributed = sum(self.holders.values())
        recent = [int(u) for u in ev.recent_used if u is not None]
        # The need: the larger of the failed request, the holders' accounting and the
        # recorded figure of the last steps (never the smaller one).
        self.base = max([int(required), attributed, *recent])
        spread = max(recent) - min(recent) if len(recent) >= 2 else 0
        frac = MARGIN_ALLOCATOR if (ev.allocator and tier == "device") else MARGIN_ACCOUNTED
        self.margin = int(max(frac * (cap or 0), spread))
        self.rows: list[dict[str, Any]] = []

    # -- the estimator's model-state bytes ---------------------------------------------
    def states(self, config: Any) -> estimator.TierEstimate | None:
        """Per-replica model states of ``config`` (fp32 training, SC20 accounting)."""
        if not self.ev.num_params:
            return None
        return estimator.estimate_for_config(
            int(self.ev.num_params),
            self.n,
            config,
            precision="fp32",
            optimizer=self.ev.optimizer,
            page_rounding=True,
        )

    def tier_need(self, config: Any, tier: str) -> int | None:
        """Model-state bytes of ``config`` on ``tier`` for the local replicas."""
        est = self.states(config)
        return None if est is None else est.bytes_on(tier) * self.ev.local_replicas

    # -- one candidate -----------------------------------------------------------------
    def add(
        self,
        change: Mapping[str, Any],
        after: int | None,
        cost: str,
        text: str,
        *,
        floor: int | None = None,
        moves: Mapping[str, int] | None = None,
        machine: bool = False,
        frees: int | None = None,
        margin: int | None = None,
    ) -> None:
        """Label one candidate: ``after`` = predicted bytes on the failed tier (None:
        unknown), ``floor`` = bytes no such change removes, ``moves`` = target tier ->
        bytes it must take. "does not fit" when the floor or ``after`` is over the
        capacity (``missing_bytes`` = bytes over it); "fits" when ``after`` plus the
        margin is within it; "may fit" when only the margin is short (``missing_bytes``
        = bytes of margin missing) or ``after`` is unknown. ``margin`` overrides the
        replay's margin when the change moves the check to another figure (e.g. stage 3:
        the pool's own accounting instead of an allocator's reading)."""
        cap = self.cap
        margin = self.margin if margin is None else int(margin)
        verdict, missing = "may fit", None
        if cap is None:
            verdict = "may fit"
        elif floor is not None and floor > cap:
            verdict, missing = "does not fit", floor - cap
        elif after is not None and after > cap:
            # The replay puts the tier over its capacity even without a margin.
            verdict, missing = "does not fit", after - cap
        elif after is not None:
            missing = max(0, after + margin - cap)
            verdict = "fits" if missing == 0 else "may fit"
        for target, nbytes in (moves or {}).items():
            room = self.free.get(target)
            need = int(nbytes * (1 + MARGIN_TARGET))
            if room is None:
                continue
            if nbytes > room:
                verdict, missing = "does not fit", max(missing or 0, nbytes - room)
                text += f"; {target} has only {fmt_bytes(room)} free"
            elif need > room and verdict == "fits":
                verdict, missing = "may fit", need - room
        if frees is None:
            frees = 0 if after is None else max(0, self.base - after)
        self.rows.append(
            {
                "change": dict(change),
                "description": text,
                "frees_bytes": int(max(0, frees)),
                "fits": verdict == "fits",
                "verdict": verdict,
                "predicted_bytes": None if after is None else int(after),
                "margin_bytes": int(margin),
                "missing_bytes": None if missing is None else int(missing),
                "speed_cost": cost,
                "_machine": machine,
            }
        )


def advise(
    *,
    failed_tier: str,
    required_bytes: int,
    capacity_bytes: int | None,
    holders: Mapping[str, int],
    config: Any,
    num_replicas: int,
    physical_bytes: Mapping[str, int | None],
    free_bytes: Mapping[str, int | None],
    implemented: set[tuple[int, str]] | None = None,
    evidence: Evidence | None = None,
) -> list[dict[str, Any]]:
    """Single config changes for a failed step, each replayed and labelled, ranked.

    Args:
        failed_tier: 'device' | 'host' | 'nvme'.
        required_bytes: bytes the tier needed at the failure (used plus the request).
        capacity_bytes: the tier's budget, bytes (None: unbounded or unknown).
        holders: kind -> bytes on the failed tier ('param', 'grad', 'optimizer').
        config: the active ZeroConfig.
        num_replicas: N_d.
        physical_bytes: tier -> bytes the hardware could give the tier at most (None:
            unknown).
        free_bytes: tier -> bytes still free on each *target* tier (None: unknown).
        implemented: (stage, offload_optimizer) pairs the strategy implements (None: all).
        evidence: the recorded figures (:class:`Evidence`); None = the holders only,
            the runtime's accounting.

    Returns:
        ``[{"rank", "change", "description", "frees_bytes", "fits", "verdict",
        "predicted_bytes", "margin_bytes", "missing_bytes", "speed_cost"}]``, rank 1 =
        best: "fits" first, then "may fit", then "does not fit"; within a verdict,
        changes of the job (no more hardware) before a budget raise, then by speed
        cost, then by bytes freed. A verified change of the job thus ranks above a
        budget raise. A change of the job that frees nothing on the failed tier
        (``frees_bytes`` 0, e.g. one whose effect the replay cannot predict) is left out.
        ``fits`` is ``verdict == "fits"`` (the schema's version-1 flag).

    Raises:
        ValueError: ``failed_tier`` is not a tier name.
    """
    if failed_tier not in ("device", "host", "nvme"):
        raise ValueError(f"failed_tier={failed_tier!r} is invalid: expected device, host or nvme")
    ev = evidence or Evidence()
    n = max(1, int(num_replicas))
    r = _Replay(
        failed_tier, required_bytes, capacity_bytes, holders, config, n, physical_bytes,
        free_bytes, ev,
    )  # fmt: skip
    if failed_tier == "device":
        if config.stage == 3:
            _device_stage3(r, implemented)
        else:
            _device_stages012(r, implemented)
    else:
        _offload_tier(r, implemented)
    _budget_raise(r)
    # A change of the job that frees nothing on the failed tier is no advice.
    r.rows = [c for c in r.rows if c["_machine"] or c["frees_bytes"] > 0]
    order = {v: i for i, v in enumerate(VERDICTS)}
    r.rows.sort(
        key=lambda c: (
            order[c["verdict"]],
            c["_machine"],
            SPEED_COSTS.index(c["speed_cost"]),
            -c["frees_bytes"],
        )
    )
    for i, c in enumerate(r.rows, 1):
        c.pop("_machine")
        c["rank"] = i
    return r.rows


def _impl(implemented, stage: int, offload: str) -> bool:
    return implemented is None or (stage, offload) in implemented


def _device_stages012(r: _Replay, implemented) -> None:
    """Device tier, stages 0-2: the holders move or shrink; the rest (activations,
    framework buffers) is carried over unchanged."""
    c, n, base = r.config, r.n, r.base
    opt, grad, param = (r.holders.get(k, 0) for k in ("optimizer", "grad", "param"))
    if opt and c.offload_optimizer == "none" and c.stage > 0:
        for target, cost in (("cpu", "low"), ("nvme", "high")):
            if target == "nvme" and not c.nvme_path:
                continue
            if not _impl(implemented, c.stage, target):
                continue
            tier = "host" if target == "cpu" else "nvme"
            r.add(
                {"offload_optimizer": target},
                base - opt,
                cost,
                f"offload optimizer states to {tier}, freeing {fmt_bytes(opt)} of device",
                moves={tier: opt},
            )
    keep = (n - 1) / n
    if c.stage == 0 and (opt or grad or param) and n > 1:
        # Plain data parallelism: every replica holds all model states (SC20 §3.1); each
        # ZeRO stage partitions one more of them over the N replicas (§5.1).
        if _impl(implemented, 1, "none"):
            r.add(
                {"stage": 1},
                base - int(opt * keep),
                "low",
                f"ZeRO stage 1 partitions optimizer states (1/{n} per replica)",
            )
        if _impl(implemented, 2, "none"):
            r.add(
                {"stage": 2},
                base - int((opt + grad) * keep),
                "low",
                f"ZeRO stage 2 partitions optimizer states and gradients (1/{n})",
            )
    if c.stage == 1 and grad and n > 1 and _impl(implemented, 2, c.offload_optimizer):
        r.add(
            {"stage": 2},
            base - int(grad * keep),
            "low",
            f"ZeRO stage 1 -> 2 keeps only the reduced gradient shard (1/{n})",
        )
    plan = r.ev.stage3_plan
    if c.stage in (0, 1, 2) and param and plan is not None and _impl(implemented, 3, "cpu"):
        # ZeRO-Infinity: parameters and states leave the device. The paged pool keeps
        # its device tier within the budget by moving gathered buffers to host memory;
        # it must hold the persistent parameters and the largest unit's working set on
        # every local replica (the estimator's figures).
        local = r.ev.local_replicas
        after = plan.device_bytes * local
        change = {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}
        r.add(
            change,
            after,
            "medium",
            "ZeRO-Infinity: stage 3 with parameters and optimizer states in host memory; "
            "the device keeps only the small persistent parameters and the units in use "
            f"(largest: `{plan.largest_unit}`), {fmt_bytes(plan.device_bytes)} per replica "
            f"x {local} by the estimator",
            floor=after,
            moves={"host": plan.host_bytes * local},
            # At stage 3 the check reads the pool's own deterministic accounting, not the
            # allocator whose step-to-step spread set this replay's margin.
            margin=int(MARGIN_ACCOUNTED * (r.cap or 0)),
        )


def _stage3_need(r: _Replay, config: Any) -> tuple[int | None, int]:
    """Stage 3, the device bytes of ``config`` for the local replicas: (an upper bound,
    every unit gathered at once plus the device states; None without units), and the
    floor (the largest unit on every live replica)."""
    ev = r.ev
    largest = ev.largest_unit
    floor = (largest.gathered_bytes if largest else 0) * ev.local_replicas
    if not ev.units:
        return None, floor
    # Optimizer slots per parameter shard: fp32 K / 4 (Adam's m and v: 2; 2 if unknown).
    k = estimator.OPTIMIZER_STATE_BYTES.get(ev.optimizer, {}).get("fp32")
    slots = 2 if k is None else k // 4
    shards = ev.shard_bytes if config.offload_param == "none" else 0
    shards += slots * ev.shard_bytes if config.offload_optimizer == "none" else 0
    per_replica = shards + ev.persistent_bytes + sum(u.gathered_bytes for u in ev.units)
    return per_replica * ev.local_replicas + r.holders.get("grad", 0), floor


def _device_stage3(r: _Replay, implemented) -> None:
    """Device tier, stage 3: shards move off the device; the gathered units stay."""
    c = r.config
    _, floor = _stage3_need(r, c)
    for key, value, cost in (
        ("offload_param", "cpu", "medium"),
        ("offload_optimizer", "cpu", "low"),
    ):
        if getattr(c, key) != "none" or not _impl(implemented, 3, c.offload_optimizer):
            continue
        new = c.replace(**{key: value})
        upper, _ = _stage3_need(r, new)
        moved = r.ev.shard_bytes * (1 if key == "offload_param" else 2) * r.ev.local_replicas
        r.add(
            {key: value},
            upper,
            cost,
            f"{key}={value}: move the {'parameter' if key == 'offload_param' else 'optimizer'}"
            " shards to host memory (the gathered units stay on the device)",
            floor=floor,
            moves={"host": moved} if moved else None,
            frees=r.holders.get("param" if key == "offload_param" else "optimizer", 0),
        )
    total = sum(u.elements for u in r.ev.units)
    largest = r.ev.largest_unit
    live = int(getattr(c, "max_live_parameters", 0) or 0)
    if largest is not None and live < total:
        # Only below the gathered elements does the limit change anything; never below
        # the largest unit (it is gathered whole).
        new_live = max(largest.elements, live // 2)
        upper, _ = _stage3_need(r, c)
        now = _live_upper(r.ev.units, live) * r.ev.local_replicas
        then = _live_upper(r.ev.units, new_live) * r.ev.local_replicas
        if new_live < live and upper is not None and then < now:
            after = upper - sum(u.gathered_bytes for u in r.ev.units) * r.ev.local_replicas
            r.add(
                {"max_live_parameters": new_live},
                after + then,
                "medium",
                f"lower max_live_parameters to {new_live} elements (at least the largest "
                f"unit, {largest.name}): at most {fmt_bytes(then)} gathered at once",
                floor=floor,
                frees=now - then,
            )


def _live_upper(units: Sequence[Unit], live: int) -> int:
    """Gathered bytes of one replica with at most ``live`` elements gathered at once, an
    upper bound: the ``k`` units with the most bytes, where ``k`` is how many units fit
    in ``live`` elements at most (the smallest first); at least the largest unit."""
    k = total = 0
    for elements in sorted(u.elements for u in units):
        if total + elements > live:
            break
        total += elements
        k += 1
    return sum(sorted((u.gathered_bytes for u in units), reverse=True)[: max(1, k)])


def _offload_tier(r: _Replay, implemented) -> None:
    """Host or NVMe tier: move the states to the other offload tier."""
    c, tier = r.config, r.tier
    if tier == "host" and c.offload_optimizer == "cpu" and c.nvme_path:
        if _impl(implemented, c.stage, "nvme"):
            new = c.replace(offload_optimizer="nvme")
            r.add(
                {"offload_optimizer": "nvme"},
                r.tier_need(new, "host"),
                "high",
                "move optimizer states from host memory to NVMe",
                moves={"nvme": r.tier_need(new, "nvme") or r.holders.get("optimizer", 0)},
            )
    if tier == "host" and c.stage == 3 and c.offload_param == "cpu" and c.nvme_path:
        new = c.replace(offload_param="nvme")
        r.add(
            {"offload_param": "nvme"},
            r.tier_need(new, "host"),
            "high",
            "move parameter shards from host memory to NVMe",
            moves={"nvme": r.tier_need(new, "nvme") or 0},
        )
    if tier == "nvme" and c.offload_optimizer == "nvme" and _impl(implemented, c.stage, "cpu"):
        new = c.replace(offload_optimizer="cpu")
        host = r.tier_need(new, "host")
        r.add(
            {"offload_optimizer": "cpu"},
            r.tier_need(new, "nvme"),
            "low",
            "keep optimizer states in host memory instead of NVMe"
            + (f" ({fmt_bytes(host)})" if host else ""),
            moves={"host": host if host is not None else r.holders.get("optimizer", 0)},
        )


def _budget_raise(r: _Replay) -> None:
    """Raise the failed tier's budget to the replayed need plus the margin, if the
    machine physically has it."""
    c, tier, cap = r.config, r.tier, r.cap
    key = f"{tier}_budget_bytes"
    if cap is None or not hasattr(c, key):
        return
    need = r.base
    why = "the step's need"
    if tier == "device" and c.stage == 3:
        upper, _ = _stage3_need(r, c)
        if upper is not None and upper > need:
            need, why = upper, "every unit gathered at once plus the device shards"
    elif tier == "device" and r.ev.allocator and r.ev.recent_peaks:
        # The boundary reading of a later step can exceed this one's; the in-step
        # peak bounds every tensor the step allocates.
        peak = max(r.ev.recent_peaks)
        if peak > need:
            need, why = peak, "the step's in-step allocator peak"
    elif tier in ("host", "nvme"):
        states = r.tier_need(c, tier)
        if states is not None and states > need:  # the failure stops the placement early
            need, why = states, f"the model states the config puts on {tier}"
    # A pool fails at the first page it cannot place: without a model of the whole need
    # (Ψ, or stage 3's units) the figure is only a lower bound, never verified.
    lower_bound = (tier in ("host", "nvme") and not r.ev.num_params) or (
        tier == "device" and c.stage == 3 and not r.ev.units
    )
    quantum = max(1 << 20, int(getattr(c, "page_size_bytes", 0) or 0))
    target = _round_up(need * (1 + MARGIN_TARGET), quantum)
    phys = r.physical.get(tier)
    text = f"raise {key} to {fmt_bytes(target)} ({why} plus a margin, rounded up)"
    if phys is not None and target > phys:
        text += f"; this machine has {fmt_bytes(phys)} for the tier"
    r.cap = target  # the replay under the raised budget
    r.margin = 0
    r.add(
        {key: int(target)},
        need,
        "none",
        text,
        machine=True,
        frees=target - cap,
    )
    r.cap = cap
    row = r.rows[-1]
    if phys is None or lower_bound:
        row["verdict"], row["fits"], row["missing_bytes"] = "may fit", False, None
        if lower_bound:
            row["description"] += "; the need beyond the failed page is not known"
    elif target > phys:
        row["verdict"], row["fits"] = "does not fit", False
        row["missing_bytes"] = int(target - phys)
    row["margin_bytes"] = int(target - need)


def diagnose(
    failed_tier: str,
    capacity_bytes: int | None,
    required_bytes: int,
    holders: Mapping[str, int],
    evidence: Evidence | None,
) -> str:
    """The cause of the failure in one sentence, for the head of the summary.

    Named in this order: a stage-3 unit whose gathered parameters on every live replica
    exceed the budget; otherwise the largest holder kind (``holders``: kind -> bytes,
    'param', 'grad', 'optimizer', 'activation', 'other'); otherwise the bytes over.
    """
    ev = evidence or Evidence()
    unit = ev.largest_unit
    cap = capacity_bytes
    if failed_tier == "device" and unit is not None and cap is not None:
        live = ev.local_replicas
        if unit.gathered_bytes * live > cap:
            return (
                f"the largest gathered unit, `{unit.name}` {fmt_bytes(unit.gathered_bytes)} "
                f"per replica × {live} replica{'s' if live != 1 else ''}, exceeds the "
                f"{failed_tier} budget of {fmt_bytes(cap)}"
            )
    kinds = {k: v for k, v in holders.items() if v}
    over = "" if cap is None else f" by {fmt_bytes(max(0, required_bytes - cap))}"
    if kinds:
        kind, nbytes = max(kinds.items(), key=lambda kv: kv[1])
        label = {
            "param": "parameters",
            "grad": "gradients",
            "optimizer": "optimizer states",
            "other": "activations, scratch and framework buffers",
        }
        return (
            f"the {failed_tier} tier's need exceeds its budget{over}; its largest holder is "
            f"{label.get(kind, kind)} ({fmt_bytes(nbytes)})"
        )
    return f"the {failed_tier} tier's need exceeds its budget{over}"


def recent_figures(records: Sequence[Any], tier: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(used, peak) bytes of ``tier`` in ``records`` (StepStats, oldest first), finite
    values only."""
    used, peaks = [], []
    for rec in records:
        t = rec.tiers.get(tier)
        if t is None:
            continue
        if math.isfinite(t.used_bytes):
            used.append(int(t.used_bytes))
        if math.isfinite(t.peak_bytes):
            peaks.append(int(t.peak_bytes))
    return tuple(used), tuple(peaks)
