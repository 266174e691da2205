"""Keras's own saving of a partitioned optimizer: ``model.save`` and ``load_model``.

A partitioned optimizer (:mod:`zero_runtime.optim.partitioned`) keeps its per-element
states (Adam's ``momentum`` and ``velocity``, SGD's ``momentum``) as per-replica shards on
the device, host or NVMe tier, outside Keras's variables. :class:`KerasSaving`, a base of
the ZeRO update mixin, makes Keras's ``.keras`` archive hold them anyway, in exactly the
stock optimizer's layout, so that the file is a plain Keras file:

- **Class.** Keras writes an object's class from ``obj.__class__`` (Keras 3.15,
  ``serialization_lib.serialize_keras_object`` -> ``serialize_with_public_class``): a class
  found in Keras's exported-name table (``api_export.get_name_from_symbol``) is written as
  that public name (``{"module": "keras.optimizers", "class_name": "Adam",
  "registered_name": None}``), any other as its ``__module__``, ``__name__`` and
  registered name. Every class built on :class:`KerasSaving` is entered in that table
  under the name of its *stock class* (:func:`stock_class`: ``zero_runtime.optim.Adam``
  -> ``keras.optimizers.Adam``) when it is defined (``__init_subclass__``); a class
  behind a user's registered optimizer subclass gets the user class's registered name.
  No Keras function is replaced: the entry is the kind ``keras_export`` itself makes, and
  only the class -> name direction is added, so ``keras.optimizers.Adam`` in a file still
  deserialises to the stock class. The constructor arguments (``get_config``) are the
  stock class's already. The old registration (``"zero_runtime>Adam"``) stays, so files
  written before still load (with ``zero_runtime`` imported).
- **Variables** (:meth:`KerasSaving.save_own_variables`): Keras's
  ``BaseOptimizer.save_own_variables`` stores ``optimizer.variables`` as ``"0"``,
  ``"1"``, ...; for the stock class those are ``iterations``, ``learning_rate`` (unless a
  schedule), EMA averages and gradient accumulators when enabled (``BaseOptimizer.build``),
  then what the family's ``build`` adds: Adam's slots interleaved per trainable variable
  (one ``add_optimizer_variables`` call: ``momentum/0, velocity/0, momentum/1, ...``; none
  for a variable with ``overwrite_with_gradient``), RMSprop's grouped per slot (one call
  per slot), Nadam's followed by ``_u_product``. The order is taken from a *stock twin*
  (:meth:`KerasSaving._keras_stock_layout`: the stock class built on one-element
  stand-ins), each entry being one of the partitioned optimizer's own variables or a slot
  gathered from the shards (the inverse of
  :func:`zero_runtime.optim.partition.build_shard`, with the sharded checkpoint's
  :class:`~zero_runtime.optim.training_state.TrainingState` geometry), written with its
  variable's shape and dtype.
- **Loading** (:meth:`KerasSaving.load_own_variables`): ``keras.models.load_model``
  builds the optimizer in ``compile_from_config`` (when the model is built) *before* it
  calls ``load_own_variables``, so the shards normally exist: each slot is cut into this
  worker's replicas' shards (``build_shard``) and written to its tier, as a sharded
  checkpoint's restore does. Where Keras loads before the build (``model.load_weights``
  of a ``.keras`` file into a compiled model that has not trained yet), the values are
  held and scattered as soon as ``build`` returns (every ``build`` defined on a subclass
  is wrapped for that, :meth:`KerasSaving.__init_subclass__`). A stock ``.keras`` file
  loaded inside ``strategy.scope()`` builds a stock optimizer there, which the strategy
  makes partitioned (:mod:`zero_runtime.optim.adopt`). Outside a ZeroInfinityStrategy a
  partitioned optimizer is the stock one (its own variables; nothing to scatter).

Gathering needs the whole state in this process. :meth:`KerasSaving.save_own_variables`
refuses (:class:`KerasSaveRefusedError`, naming ``strategy.save_checkpoint``) when the
gathered state would exceed a share of the available host memory
(:func:`gather_limit_bytes`: ``psutil.virtual_memory().available`` times
:data:`DEFAULT_GATHER_SHARE` = 0.5, or the share in the environment variable
:data:`GATHER_SHARE_ENV`), when shards live in other worker processes, or for stage-3
row-paged embedding tables (lazy per-page states); before raising it removes the
``.keras`` archive Keras had started, so nothing half-written is left.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import sys
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import psutil
import tensorflow as tf
from keras.src import api_export
from keras.src.saving import object_registration

#: Share of the available host memory (``psutil.virtual_memory().available``) a gathered
#: optimizer state may take in ``model.save`` (float in (0, 1]).
DEFAULT_GATHER_SHARE = 0.5
#: Environment variable overriding :data:`DEFAULT_GATHER_SHARE` (read at every save).
GATHER_SHARE_ENV = "ZERO_RUNTIME_KERAS_GATHER_SHARE"

# Frames searched above save_own_variables for the archive Keras is writing (Keras 3.15:
# _save_state once per level of the model's tree, then _save_model_to_fileobj).
_MAX_FRAMES = 64


class KerasSaveRefusedError(RuntimeError):
    """``model.save`` cannot put this partitioned optimizer's state in a ``.keras`` file.

    Raised by :meth:`KerasSaving.save_own_variables` before anything of the optimizer is
    written; the ``.keras`` archive Keras had started is removed (``removed``).

    Attributes:
        bytes_needed: host bytes the gather would take (int), or None when the refusal
            is not about memory (shards on other workers, row-paged tables).
        bytes_limit: the limit those bytes exceed (int, :func:`gather_limit_bytes`), or
            None.
        removed: the path of the partial archive removed, or None.
    """

    def __init__(
        self,
        message: str,
        bytes_needed: int | None = None,
        bytes_limit: int | None = None,
        removed: str | None = None,
    ) -> None:
        super().__init__(message)
        self.bytes_needed = bytes_needed
        self.bytes_limit = bytes_limit
        self.removed = removed


def gather_share() -> float:
    """The share of available host memory a ``model.save`` gather may use: the float in
    :data:`GATHER_SHARE_ENV` if set, else :data:`DEFAULT_GATHER_SHARE` (0.5).

    Raises:
        ValueError: the environment variable is not a number in (0, 1].
    """
    raw = os.environ.get(GATHER_SHARE_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_GATHER_SHARE
    try:
        share = float(raw)
    except ValueError:
        share = math.nan
    if not 0.0 < share <= 1.0:
        raise ValueError(f"{GATHER_SHARE_ENV}={raw!r}: expected a number in (0, 1]")
    return share


def gather_limit_bytes() -> int:
    """Bytes a ``model.save`` gather may take on this host: :func:`gather_share` times
    ``psutil.virtual_memory().available`` (read now), rounded down."""
    return int(gather_share() * psutil.virtual_memory().available)


def stock_class(cls: type) -> type | None:
    """The class a partitioned optimizer class is saved as: the first class of its MRO
    that is a ``keras.optimizers.Optimizer`` and not built on :class:`KerasSaving`
    (``zero_runtime.optim.Adam`` -> ``keras.optimizers.Adam``; an adopted subclass of a
    user's ``MyAdam`` -> ``MyAdam``), or None for a class that is no Keras optimizer (a
    mixin)."""
    return next(
        (
            c
            for c in cls.__mro__
            if issubclass(c, keras.optimizers.Optimizer) and not issubclass(c, KerasSaving)
        ),
        None,
    )


def _serialize_as_stock(cls: type) -> None:
    """Enter ``cls`` in Keras's serialization tables under its :func:`stock_class`'s name
    (the class -> name direction only; see the module docstring)."""
    stock = stock_class(cls)
    if stock is None:
        return
    public = api_export.get_name_from_symbol(stock)
    if public is not None:
        api_export.REGISTERED_OBJS_TO_NAMES[cls] = public
    elif stock in object_registration.GLOBAL_CUSTOM_NAMES:
        # A user's registered class: module and name are copied by adopt.py's subclass.
        object_registration.GLOBAL_CUSTOM_NAMES[cls] = object_registration.GLOBAL_CUSTOM_NAMES[
            stock
        ]


def _applying_held_state(build):
    """``build`` followed by :meth:`KerasSaving._keras_apply_held_state` when it is the
    outermost one (a subclass's ``build`` calling its base's applies once, at its end)."""

    @functools.wraps(build)
    def wrapper(self, *args, **kwargs):
        depth = self._keras_build_depth
        object.__setattr__(self, "_keras_build_depth", depth + 1)
        try:
            result = build(self, *args, **kwargs)
        finally:
            object.__setattr__(self, "_keras_build_depth", depth)
        if depth == 0:
            self._keras_apply_held_state()
        return result

    wrapper._keras_applies_held_state = True
    return wrapper


class KerasSaving:
    """Mixin of the partitioned optimizers: Keras's ``save_own_variables`` /
    ``load_own_variables`` with the whole state in the stock class's layout, and
    serialization as the stock class (module docstring).

    Mixed into ``_PartitionedUpdate`` (zero_runtime/optim/partitioned.py) ahead of the
    update mixins. Defining a subclass (``__init_subclass__``) enters it in Keras's
    serialization tables under its :func:`stock_class` and wraps a ``build`` defined on
    it so that state loaded before the build is scattered once the shards exist.
    """

    #: ``{key: value}`` read by :meth:`load_own_variables` before ``build`` (else None).
    _keras_held_state: dict[str, np.ndarray] | None = None
    #: ``build`` calls in progress (wrapped builds nest through ``super().build``).
    _keras_build_depth: int = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _serialize_as_stock(cls)
        build = cls.__dict__.get("build")
        if build is not None and not getattr(build, "_keras_applies_held_state", False):
            cls.build = _applying_held_state(build)

    # -- Keras's saving API ----------------------------------------------------------------
    def save_own_variables(self, store) -> None:
        """Write the optimizer's whole state into Keras's weights ``store``, keys ``"0"``,
        ``"1"``, ... in the stock optimizer's order (:meth:`_keras_stock_layout`).

        Unpartitioned (not built, or running the stock update: stage 0, below
        ``mirrored_fallback_bytes``, no ZeroInfinityStrategy): Keras's own method. Built
        and partitioned: the stock class's variables, each either one of this
        optimizer's own (``iterations``, ``learning_rate``, ...) or a slot gathered from
        every replica's shard, one array per trainable variable with its shape and dtype
        (float32 for float32 variables). Peak host memory: the gathered slots plus one
        slot's shards.

        Args:
            store: the mapping Keras passes (an ``H5IOStore`` entry; ``store[key] = array``).

        Raises:
            KerasSaveRefusedError: the gathered state would exceed
                :func:`gather_limit_bytes`; the optimizer's shards are on several worker
                processes; stage-3 row-paged embedding tables; or a stock variable this
                optimizer has no counterpart for. The message names
                ``strategy.save_checkpoint(...)``; the partial ``.keras`` archive is
                removed first.
        """
        held = self._keras_held_state
        if held is not None and not self.built:  # loaded, not built yet: as loaded
            for key, value in held.items():
                store[key] = value
            return
        if getattr(self, "_zero", None) is None:
            super().save_own_variables(store)
            return
        state = self._keras_training_state()
        layout, unknown = None, None
        if len(state.dense) == len(state.params):
            try:
                layout = self._keras_stock_layout(state)
            except _UnknownLayoutError as exc:
                unknown = str(exc)
        self._keras_check_gather(state, unknown)
        keys: dict[tuple[int, str], str] = {}
        for key, entry in enumerate(layout):
            if isinstance(entry, tuple):
                keys[entry] = str(key)
            else:
                store[str(key)] = entry.numpy()
        n = state.layout.num_shards
        for slot in state.slots:
            shards = [state.store.read_shard(r, slot) for r in range(n)]
            flats = _gathered(state.layout, shards, state.sizes)
            del shards
            for j, i in enumerate(state.dense):
                if (i, slot) in keys:
                    value = _logical_value(state, i, flats[j])
                    store[keys[(i, slot)]] = _as_dtype(value, state.params[i].dtype)
            del flats

    def load_own_variables(self, store) -> None:
        """Load a ``.keras`` file's optimizer state (the stock optimizer's layout).

        Built and partitioned: this optimizer's own variables (``iterations``,
        ``learning_rate``, ...) are assigned and each slot is cut into this worker's
        replicas' shards and written to its tier. Built as the stock optimizer: assigned
        to its variables (Keras's own method). Not built yet: the values are held until
        ``build`` returns. A file with only the variables before the slots (written by
        zero_runtime before ``.keras`` files held the slots, or by an optimizer that had
        not been built) loads those and warns that the slots start at zero; another
        count warns and loads nothing, as Keras does.

        Args:
            store: the mapping Keras passes (``store.keys()``, ``store[key]`` -> array).

        Raises:
            ValueError: a saved slot's shape differs from its variable's; stage-3
                row-paged embedding tables, or a stock variable this optimizer has no
                counterpart for (restore a sharded checkpoint instead).
        """
        values = {key: np.asarray(store[key]) for key in store.keys()}
        if not self.built:
            object.__setattr__(self, "_keras_held_state", values)
            return
        self._keras_load_values(values)

    # -- helpers -------------------------------------------------------------------------
    def _keras_apply_held_state(self) -> None:
        """Load the values held by :meth:`load_own_variables` (called after ``build``)."""
        held = self._keras_held_state
        if held is None or not self.built:
            return
        object.__setattr__(self, "_keras_held_state", None)
        with tf.init_scope():  # eagerly, also when Keras builds inside a traced step
            self._keras_load_values(held)

    def _keras_load_values(self, values: Mapping[str, np.ndarray]) -> None:
        if getattr(self, "_zero", None) is None:
            variables = self.variables
            per_variable = len(getattr(self, "_zero_slots", ()))
            with_slots = sum(
                1
                for v in getattr(self, "_trainable_variables", [])
                if not self._overwrite_variable_with_gradient(v)
            )
            before_slots = len(variables) - per_variable * with_slots
            if per_variable and len(values) == before_slots:
                self._keras_load_prefix(variables[:before_slots], values)
                return
            super().load_own_variables(_Values(values))
            return
        state = self._keras_training_state()
        advice = "restore a sharded checkpoint instead (strategy.load_checkpoint(directory, model))"
        if len(state.dense) != len(state.params):
            raise ValueError(
                f"optimizer {self.name!r}: stage-3 row-paged embedding tables keep lazy "
                f"per-page optimizer states that a .keras file cannot restore; {advice}"
            )
        try:
            layout = self._keras_stock_layout(state)
        except _UnknownLayoutError as exc:
            raise ValueError(f"optimizer {self.name!r}: {exc}; {advice}") from None
        leading = next((k for k, e in enumerate(layout) if isinstance(e, tuple)), len(layout))
        if len(values) == leading < len(layout):
            self._keras_load_prefix(layout[:leading], values)
            return
        if len(values) != len(layout):
            warnings.warn(
                f"Skipping variable loading for optimizer '{self.name}', because it has "
                f"{len(layout)} variables whereas the saved optimizer has "
                f"{len(values)} variables.",
                stacklevel=3,
            )
            return
        keys = {}
        for key, entry in enumerate(layout):
            if isinstance(entry, tuple):
                keys[entry] = str(key)
            else:
                entry.assign(values[str(key)])
        for slot in state.slots:
            flats = {}
            for j, i in enumerate(state.dense):
                variable = state.params[i]
                shape = tuple(int(d) for d in variable.shape)
                if (i, slot) not in keys:  # overwrite_with_gradient: no state
                    flats[j] = np.zeros(math.prod(shape), np.float32)
                    continue
                value = values[keys[(i, slot)]]
                if tuple(value.shape) != shape:
                    raise ValueError(
                        f"optimizer {self.name!r}: saved {slot} #{keys[(i, slot)]} has shape "
                        f"{tuple(value.shape)}, variable {variable.path!r} has {shape}"
                    )
                flats[j] = state.moved_flat(i, np.asarray(value, np.float32))
            _scatter(state, slot, flats)
            del flats

    def _keras_load_prefix(self, prefix: Sequence, values: Mapping[str, np.ndarray]) -> None:
        for i, variable in enumerate(prefix):
            variable.assign(values[str(i)])
        warnings.warn(
            f"optimizer '{self.name}': the file holds its {len(prefix)} variables before the "
            "per-variable states but no states (written by zero_runtime before .keras files "
            "held them, or by an optimizer that was not built): the states "
            f"({', '.join(getattr(self, '_zero_slots', ()))}) start from zero",
            stacklevel=4,
        )

    def _keras_training_state(self):
        """The sharded checkpoint's geometry of this optimizer's state (no model)."""
        from zero_runtime.optim.training_state import TrainingState
        from zero_runtime.sharded_variable import ShardedVariable

        settle = getattr(self, "zero_settle", None)
        if settle is not None:
            settle()  # a failed step is rolled back before the states are read or written
        zero = self._zero
        strategy = self._distribution_strategy
        params = list(self._trainable_variables)
        dense = tuple(i for i, v in enumerate(params) if not getattr(v, "row_paged", False))
        sharded = bool(params) and all(isinstance(v, ShardedVariable) for v in params)
        cluster = getattr(strategy, "cluster", None)
        rank = cluster.rank if cluster is not None else 0
        num_workers = cluster.num_workers if cluster is not None else 1
        local_n = len(zero.devices)
        return TrainingState(
            model=None,
            optimizer=self,
            strategy=strategy,
            params=params,
            dense=dense,
            tables={},
            layout=zero.layout,
            kind="rows" if sharded else "flat",
            store=zero.store,
            slots=tuple(zero.store.slot_names),
            replicated=[],
            local_replicas=tuple(rank * local_n + i for i in range(local_n)),
            rank=rank,
            num_workers=num_workers,
        )

    def _keras_stock_layout(self, state) -> list:
        """The stock class's ``variables``, in order, as this optimizer's counterparts:
        one of its own variables, or ``(position in params, slot name)`` for a slot.

        Derived from a *stock twin*: the :func:`stock_class` built from ``get_config()``
        on one-element stand-ins of the trainable variables (``overwrite_with_gradient``
        copied), in a helper thread, so that no strategy scope, variable creator or
        adoption of the caller's thread applies (all are thread-local). A twin variable
        made by ``add_variable_from_reference(stand-in k, name=slot)`` (named
        ``"<stand-in>_<slot>"``) is a slot when ``slot`` is one of the store's; any other
        is matched to this optimizer's attribute holding it on the twin (``_iterations``,
        ``_learning_rate``, ``_model_variables_moving_average[k]``, ...). So the order is
        Keras's own: slots interleaved per variable (Adam), grouped per slot (RMSprop),
        or followed by other variables (Nadam's ``_u_product``).

        Raises:
            _UnknownLayoutError: a twin variable with no counterpart here.
        """
        twin = _stock_twin(type(self), self.get_config(), state.params, self)
        owners = _owners(twin)
        slots = set(state.slots)
        layout: list = []
        for tv in twin.variables:
            name = str(tv.name)
            ref, _, slot = name.partition("_")
            if ref.startswith(_STAND_IN) and ref[len(_STAND_IN) :].isdigit() and slot in slots:
                layout.append((int(ref[len(_STAND_IN) :]), slot))
                continue
            attr, index = owners.get(id(tv), (None, None))
            own = getattr(self, attr, None) if attr is not None else None
            if own is not None and index is not None:
                own = own[index] if index < len(own) else None
            if not isinstance(own, keras.Variable):
                raise _UnknownLayoutError(
                    f"{stock_class(type(self)).__name__}'s variable {name!r} has no "
                    f"counterpart in the partitioned {type(self).__name__}"
                )
            layout.append(own)
        return layout

    def _keras_check_gather(self, state, unknown: str | None = None) -> None:
        """Raise :class:`KerasSaveRefusedError` (after removing the partial archive)
        unless this process can gather the whole state within :func:`gather_limit_bytes`
        (``unknown``: why the stock layout is unknown, or None)."""
        advice = (
            "save a sharded checkpoint instead: strategy.save_checkpoint(directory, model) "
            "(each replica writes its own shards; zero_runtime.checkpoint.export(directory, "
            "'model.keras') consolidates the weights for serving)"
        )
        reason, needed, limit = None, None, None
        if state.num_workers > 1:
            reason = (
                f"its shards are spread over {state.num_workers} worker processes and "
                "model.save gathers in one"
            )
        elif len(state.dense) != len(state.params):
            reason = "stage-3 row-paged embedding tables keep lazy per-page states"
        elif unknown is not None:
            reason = unknown
        else:
            with_state = sum(
                math.prod(tuple(state.params[i].shape))
                for i in state.dense
                if not self._overwrite_variable_with_gradient(state.params[i])
            )
            slots = len(state.slots)
            needed = 4 * slots * with_state + (4 * state.layout.padded_total if slots else 0)
            limit = gather_limit_bytes()
            if needed > limit:
                reason = (
                    f"gathering its {slots} per-variable state(s) of {with_state:,} elements "
                    f"takes {needed:,} bytes of host memory, more than the {limit:,} bytes "
                    f"allowed ({gather_share():g} of the {psutil.virtual_memory().available:,} "
                    f"bytes available; {GATHER_SHARE_ENV} sets the share)"
                )
        if reason is None:
            return
        removed = _remove_partial_archive()
        where = f"; the partial file {removed!r} was removed" if removed else ""
        raise KerasSaveRefusedError(
            f"model.save cannot write optimizer {self.name!r} ({type(self).__name__}, ZeRO "
            f"stage {self._zero.stage}) into a .keras file: {reason}. Nothing was "
            f"saved{where}; {advice}",
            bytes_needed=needed,
            bytes_limit=limit,
            removed=removed,
        )


class _UnknownLayoutError(Exception):
    """The stock class has a variable the partitioned optimizer has no counterpart for."""


#: Name prefix of the stand-ins a stock twin is built on (``zrstandin0``, ...).
_STAND_IN = "zrstandin"


def _stock_twin(cls: type, config: dict, params: Sequence, optimizer) -> Any:
    """A built stock-class optimizer with ``config`` over one-element stand-ins of
    ``params``, made in a helper thread (no strategy scope, no adoption)."""
    stock = stock_class(cls)
    flags = [bool(optimizer._overwrite_variable_with_gradient(v)) for v in params]

    def make():
        twin = stock.from_config(dict(config))
        stand_ins = []
        for k, overwrite in enumerate(flags):
            v = keras.Variable(np.zeros(1, np.float32), name=f"{_STAND_IN}{k}")
            if overwrite:
                v.overwrite_with_gradient = True
            stand_ins.append(v)
        twin.build(stand_ins)
        return twin

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zr-stock-twin") as pool:
        return pool.submit(make).result()


def _owners(twin) -> dict[int, tuple[str, int | None]]:
    """``id(variable) -> (attribute, index or None)`` for the twin's variables held by an
    attribute (first one wins; ``_variables``, the list of all, is skipped)."""
    owners: dict[int, tuple[str, int | None]] = {}
    for attr, value in vars(twin).items():
        if attr == "_variables":
            continue
        if isinstance(value, keras.Variable):
            owners.setdefault(id(value), (attr, None))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if isinstance(item, keras.Variable):
                    owners.setdefault(id(item), (attr, index))
    return owners


class _Values(Mapping):
    """Held values as Keras's read store (``keys``, ``[key]``)."""

    def __init__(self, values: Mapping[str, np.ndarray]) -> None:
        self._values = values

    def __getitem__(self, key: str) -> np.ndarray:
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def _gathered(layout, shards: Sequence[np.ndarray], sizes: Sequence[int]) -> list[np.ndarray]:
    """Every tensor's canonical flat values (float32 ``[sizes[j]]``, layout order) from
    all replicas' shards: the inverse of :func:`~zero_runtime.optim.partition.
    build_shard` (padding dropped)."""
    from zero_runtime.optim.partition import replica_pieces

    flats = [np.empty(size, np.float32) for size in sizes]
    for r, shard in enumerate(shards):
        for p in replica_pieces(layout, r, sizes):
            flats[p.var][p.start : p.start + p.count] = shard[
                p.shard_offset : p.shard_offset + p.count
            ]
    return flats


def _scatter(state, slot: str, flats: Mapping[int, np.ndarray]) -> None:
    """Write ``slot``'s whole tensors (canonical flat, layout index -> values) into this
    worker's replicas' shards, as a sharded checkpoint's restore does."""
    from zero_runtime.optim.partition import build_shard

    for replica in state.local_replicas:
        state.store.write_shard(
            replica, slot, build_shard(state.layout, replica, flats, state.sizes)
        )


def _logical_value(state, i: int, flat: np.ndarray) -> np.ndarray:
    """Parameter ``i``'s slot values in its logical shape, from canonical order."""
    from zero_runtime.optim.partition import logical_from_canonical as _logical

    shape = tuple(int(d) for d in state.params[i].shape)
    if not shape:
        return flat.reshape(())
    return np.ascontiguousarray(_logical(flat, shape, state.shard_dim(i)))


def _as_dtype(value: np.ndarray, dtype) -> np.ndarray:
    """``value`` (float32) as the variable's dtype (the stock slot's dtype)."""
    name = keras.backend.standardize_dtype(dtype)
    if name == "float32":
        return value
    return keras.ops.convert_to_numpy(keras.ops.cast(value, name))


def _remove_partial_archive() -> str | None:
    """Remove the ``.keras`` archive Keras is writing (the ``zipfile.ZipFile`` open for
    writing in a caller frame of Keras's saving code, a file path); return its path, or
    None when there is none (an in-memory or remote save, a ``zipped=False`` directory)."""
    frame = sys._getframe(1)  # noqa: SLF001 - Keras opens the file before any hook runs
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        if str(frame.f_globals.get("__name__", "")).startswith("keras."):
            for value in list(frame.f_locals.values()):
                if (
                    isinstance(value, zipfile.ZipFile)
                    and value.mode == "w"
                    and isinstance(value.filename, str)
                    and os.path.isfile(value.filename)
                ):
                    os.unlink(value.filename)
                    return value.filename
        frame = frame.f_back
    return None


class TrackedZeroStates(tf.__internal__.tracking.Trackable):
    """The partitioned optimizer's per-element states as one ``tf.train.Checkpoint``
    object (TensorFlow's custom-loop checkpointing: ``tf.train.Checkpoint(model=...,
    optimizer=...)``).

    Saving gathers every slot from the shards into the stock Keras layout
    (:meth:`KerasSaving.save_own_variables`: float32 arrays keyed ``"0"``, ``"1"``, ...);
    restoring scatters them back into this worker's replicas' shards
    (:meth:`KerasSaving.load_own_variables`). Without it, a checkpoint held only the
    optimizer's ``iterations`` and learning rate, and a restored run went on with its
    moments as they were. The same refusals as ``model.save`` apply
    (:class:`KerasSaveRefusedError` for a state too large to gather on one host).

    Args:
        optimizer: the built partitioned optimizer.
    """

    def __init__(self, optimizer) -> None:
        self._optimizer = optimizer

    def _serialize_to_tensors(self) -> dict:
        store: dict = {}
        self._optimizer.save_own_variables(store)
        return {key: tf.constant(np.asarray(value)) for key, value in store.items()}

    def _restore_from_tensors(self, restored_tensors: dict):
        self._optimizer.load_own_variables(
            {key: np.asarray(t) for key, t in restored_tensors.items()}
        )
        return tf.no_op()
