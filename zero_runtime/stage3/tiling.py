"""Memory-centric tiling of wide ``Dense``/``EinsumDense``/``Embedding`` units (issue
#17, item 1).

ZeRO-Infinity (Rajbhandari et al., SC21, section 5.1.3) bounds the working memory of a
layer independently of its width: a layer whose gathered parameters exceed a budget runs
as a sequence of *tiles*, each gathered, used and released before the next one is
gathered, forward and backward (DeepSpeed's ``deepspeed.zero.TiledLinear(in_splits,
out_splits)``, which the user builds by hand; here the runtime tiles by ``tile_size``).

A tiled unit's kernel is split along one **output** axis into ``k`` column tiles of at
most ``tile_size`` elements each (a tile never splits the contracted axis, so a tile's
output columns are computed exactly as the untiled layer computes them). With the unit's
flat shard laid out as its kernel's rows (``shard_dim`` 0, the units path's layout:
replica ``r`` holds kernel rows ``[r R, (r + 1) R)``), tile ``j`` of the kernel is the
column slice ``[:, c_j : c_j + n_j]`` of *every* replica's shard, so each replica reads
only that slice of its own shard (host or NVMe tier: the host cuts it, no more than a
tile crosses to the device; device tier: sliced from the shard's variable in the graph)
and one all-gather of ``R n_j`` elements per replica yields the tile ``W_j`` (shapes for a
``Dense`` of ``D_in -> D_out``; an ``EinsumDense`` kernel tiles along its widest output
axis after the first)::

    forward   for j in 0..k-1:  W_j = all_gather(shard[:, c_j:c_j+n_j])    (D_in, n_j)
                                y_j = layer.call(x) with kernel=W_j, bias=b[c_j:c_j+n_j]
                                (W_j released; the next read waits for y_j)
              y = concat_j y_j                                               (..., D_out)
    backward  for j in k-1..0:  W_j gathered again, y_j recomputed under a tape,
                                dW_j, db_j, dx_j from dy_j = dy[..., c_j:c_j+n_j],
                                reduce-scatter [dW_j | db_j] -> this replica's rows,
                                dx += dx_j (the next tile's gather waits for this one)

An ``Embedding``'s table ``(V, C)`` tiles the same way, by columns: tile ``j`` is
``table[:, c_j : c_j + n_j]`` for every id, ``y_j = take(W_j, ids)``. (ZeRO-Infinity
tiles a table by rows; here a row range would lie in one or two replicas' row shards, an
uneven all-gather, where a column tile is a slice of every replica's shard, as for a
``Dense``.) The ids have no gradient; the tiles are ordered by a float ``carry``.

Results: the outputs and the kernel gradient equal the untiled unit's bitwise (a column
of ``x @ W`` and of ``x^T dy`` does not depend on the other columns; measured on this
machine's TF 2.21 CPU kernels, matmul and einsum alike). Two sums round differently: the
input gradient ``dx = sum_j dy_j W_j^T`` splits the contraction over ``D_out`` into ``k``
partial sums (relative ~1e-6 of the untiled ``dy W^T``, as DeepSpeed's ``TiledLinear``),
and the bias gradient's sum over the batch of a narrower ``dy_j`` may be vectorized
differently (measured 2e-11 on a 4096-wide bias).

Working set per replica while a tiled unit runs: the activations, one tile's gathered
kernel and its collective buffers (forward: the slice, the all-gather output, the view;
backward: those, ``dW_j`` and the reduce-scatter's input and output), never the whole
kernel; the reduced gradient shards accumulate to the unit's shard (``1/N`` of the
kernel), which the units path holds to the step's end anyway. The bias (``D_out``
elements, not a width-squared term) is gathered whole per tile and sliced.

What tiles: an exact ``keras.layers.Dense``, ``keras.layers.EinsumDense`` or
``keras.layers.Embedding`` (not a subclass: its ``call`` may do more), not quantized,
without LoRA, without non-trainable state, whose activation is elementwise (a
``softmax`` over the tiled axis would mix tiles), called with one tensor input (floating;
integer ids for an ``Embedding``); anything else runs untiled. The lookup and the
table's gradient (a sum per row over the ids, in id order) are bitwise the untiled
table's.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import keras
import numpy as np
import tensorflow as tf

from zero_runtime import comm
from zero_runtime.lifecycle import host_function
from zero_runtime.stage3.gather import keras_logits_positions, with_keras_logits
from zero_runtime.stage3.unit_comm import not_foldable, reduce_scatter_variables

#: Elementwise activations (keras.activations names): column tiles apply them exactly.
ELEMENTWISE_ACTIVATIONS = frozenset(
    {
        "linear", "relu", "relu6", "elu", "selu", "gelu", "silu", "swish", "tanh",
        "sigmoid", "hard_sigmoid", "hard_silu", "hard_swish", "softplus", "softsign",
        "exponential", "leaky_relu", "mish", "celu", "log_sigmoid", "sparse_plus",
        "squareplus", "tanh_shrink", "hard_tanh", "soft_shrink", "hard_shrink",
    }
)  # fmt: skip

#: The layer types that tile (exactly these: a subclass's call may do more).
_TILED = (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding)

#: ``tile_size`` derived from ``device_budget_bytes`` when it is ``'auto'``: a tile's working
#: set is about 8 float32 copies of the tile (backward: the gathered slice, the
#: all-gather output, the view, ``dW_j``, the reduce-scatter's padded input and its
#: output), given a quarter of the budget: ``budget / 4 / (8 * 4 bytes)`` elements.
BUDGET_BYTES_PER_TILE_ELEMENT = 128


def resolve_tile_size(tile_size: int | str | None, device_budget_bytes) -> int | None:
    """The tile budget in elements, or None (no tiling).

    Args:
        tile_size: the ``tile_size`` ZeroConfig key: elements (>= 1), None (no tiling) or
            ``'auto'`` (derive from the budget).
        device_budget_bytes: the ``device_budget_bytes`` key (bytes, None, or 'auto'
            resolved by the strategy to an int).

    Returns:
        ``tile_size`` when it is an int; None for None, or for ``'auto'`` without an int
        budget; else ``device_budget_bytes // BUDGET_BYTES_PER_TILE_ELEMENT`` (>= 1).
    """
    if tile_size != "auto":
        return tile_size
    if isinstance(device_budget_bytes, int) and not isinstance(device_budget_bytes, bool):
        return max(1, device_budget_bytes // BUDGET_BYTES_PER_TILE_ELEMENT)
    return None


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """How one unit's kernel is cut into column tiles.

    Attributes:
        kernel: the unit's kernel (a ShardedVariable, ``shard_dim`` 0), logical shape
            ``(D_0, *rest)``.
        kernel_axis: the tiled kernel axis (>= 1: never the sharded rows).
        output_axis: the matching axis of the layer's output, negative (from the end).
        bounds: ``((start, size), ...)`` along ``kernel_axis``, one per tile, in order.
        others: the unit's other variables (the bias) with the axis each is sliced along
            (negative, aligned with the output's trailing axes) or None (used whole).
    """

    kernel: object
    kernel_axis: int
    output_axis: int
    bounds: tuple[tuple[int, int], ...]
    others: tuple[tuple[object, int | None], ...]

    @property
    def tile_elements(self) -> int:
        """Kernel elements of the widest tile."""
        per_col = math.prod(self.kernel.shape) // self.kernel.shape[self.kernel_axis]
        return per_col * max(n for _, n in self.bounds)

    def tile_path(self, j: int) -> str:
        """Tile ``j``'s variable path, e.g. ``'mlp/kernel[:, 512:1024]'``."""
        start, size = self.bounds[j]
        index = [":"] * len(self.kernel.shape)
        index[self.kernel_axis] = f"{start}:{start + size}"
        return f"{self.kernel.path}[{', '.join(index)}]"

    def describe(self) -> str:
        """The placement table's text for the tiled kernel."""
        first, last = self.tile_path(0), self.tile_path(len(self.bounds) - 1)
        return (
            f"tiled: {len(self.bounds)} tiles along axis {self.kernel_axis} of <= "
            f"{self.tile_elements} elements, gathered one at a time ({first} .. {last})"
        )


def plan_tiles(layer, variables: tuple, tile_size: int | None) -> TilePlan | None:
    """The tile plan of a unit, or None when it runs untiled.

    Args:
        layer: the unit's Keras layer.
        variables: its sharded originals (ShardedVariables), in the unit's order.
        tile_size: the resolved tile budget (elements) or None (no tiling).

    Returns:
        A :class:`TilePlan` with ``k = ceil(columns / floor(tile_size / per_column))``
        tiles (at least 2), or None: no budget, a kernel within it, a layer that does not
        tile (see the module docstring), or a single output column already over the
        budget (tiling along the contracted axis would change the sums' order).
    """
    if tile_size is None or type(layer) not in _TILED:
        return None
    if getattr(layer, "quantization_mode", None) or getattr(layer, "lora_enabled", False):
        return None
    if layer.non_trainable_variables or _activation_name(layer) not in ELEMENTWISE_ACTIVATIONS:
        return None
    name = "_embeddings" if type(layer) is keras.layers.Embedding else "_kernel"
    kernel = next((v for v in variables if v is layer.__dict__.get(name)), None)
    if (
        kernel is None
        or getattr(kernel, "shard_dim", 0) != 0
        or math.prod(kernel.shape) <= tile_size
    ):
        return None
    axes = _output_axes(layer)
    if not axes:
        return None
    kernel_axis, output_axis = max(axes, key=lambda a: kernel.shape[a[0]])
    columns = kernel.shape[kernel_axis]
    per_col = math.prod(kernel.shape) // columns
    width = tile_size // per_col
    if width < 1:
        return None
    width = min(width, -(-columns // 2))  # at least two tiles
    bounds = tuple((s, min(width, columns - s)) for s in range(0, columns, width))
    others = []
    for v in variables:
        if v is kernel:
            continue
        shape = tuple(v.shape)
        sliced = len(shape) >= -output_axis and shape[output_axis] == columns
        others.append((v, output_axis if sliced else None))
    return TilePlan(kernel, kernel_axis, output_axis, bounds, tuple(others))


def _activation_name(layer) -> str:
    fn = getattr(layer, "activation", None)
    if fn is None:
        return "linear"
    return getattr(fn, "__name__", "")


def _output_axes(layer) -> list[tuple[int, int]]:
    """``(kernel_axis >= 1, output_axis < 0)`` pairs a column tile may cut along."""
    if type(layer) in (keras.layers.Dense, keras.layers.Embedding):
        return [(1, -1)]  # Dense (D_in, D_out) -> (..., D_out); Embedding (V, C) -> (..., C)
    inputs, rest = layer.equation.split(",")
    weights, output = rest.split("->")
    post = output.split("...")[-1]  # letters aligned with the output's end
    pairs = []
    for axis, letter in enumerate(weights):
        if axis == 0 or letter in inputs or letter not in post:
            continue
        pairs.append((axis, post.index(letter) - len(post)))
    return pairs


class TiledCall:
    """A tiled unit's use inside a step: the tiles in turn (see the module docstring).

    Args:
        plan: the unit's :class:`TilePlan`.
    """

    def __init__(self, plan: TilePlan) -> None:
        self.plan = plan

    @staticmethod
    def applies(args: tuple, kwargs: dict) -> bool:
        """True for a call with one tensor input, floating or integer (an
        ``Embedding``'s ids): ``layer(x, training=...)``."""
        tensors = [a for a in tf.nest.flatten((args, kwargs)) if tf.is_tensor(a)]
        return (
            len(args) == 1
            and len(tensors) == 1
            and tensors[0] is args[0]
            and (tensors[0].dtype.is_floating or tensors[0].dtype.is_integer)
        )

    def __call__(self, runner, unit, x: tf.Tensor, kwargs: dict) -> tf.Tensor:
        """The unit's output for input ``x`` (float, ``(..., D_in)``), tile by tile.

        Args:
            runner: the :class:`~zero_runtime.stage3.gather.UnitRunner` in a step (its
                replica, anchors, group, and the gather of the untiled variables).
            unit: the :class:`~zero_runtime.stage3.gather.Unit`.
            x: the layer's input.
            kwargs: the call's keyword arguments (``training``).
        """
        replica, anchors = runner.step_anchors()
        plan = self.plan
        kbuf, others, done = None, [], None
        if anchors is not None:
            kbuf = anchors[id(plan.kernel)]  # passed through the tiles, whole
            others = [anchors[id(v)] for v, _ in plan.others]
            done = runner.done_anchor(replica)  # the update during backward, or None
        tile = _Tile(self.plan, runner, unit, replica, kwargs)
        outs, h, carry = [], x, tf.zeros([1], tf.float32)
        for j in range(len(plan.bounds)):
            y, h, carry, kbuf = tile.run(j, h, carry, kbuf, others, done if j == 0 else None)
            outs.append(y)
        y = tf.concat(outs, axis=plan.output_axis)
        if len(keras_logits_positions(outs)) == len(outs):  # a sigmoid's logits too (run)
            logits = [o._keras_logits for o in outs]  # noqa: SLF001
            y._keras_logits = tf.concat(logits, axis=plan.output_axis)  # noqa: SLF001
        return y


@dataclasses.dataclass(frozen=True)
class _Tile:
    """One tiled use's tiles on one replica (trace time)."""

    plan: TilePlan
    runner: object
    unit: object
    replica: int
    kwargs: dict

    def run(self, j: int, x: tf.Tensor, carry: tf.Tensor, kbuf, others: list, done=None):
        """Tile ``j``: returns ``(y_j, x_next, carry_next, kbuf_next)``.

        ``carry`` (float32 ``[1]``) orders the tiles: tile ``j``'s read waits for the
        previous tile's output, and in backward the gradient of ``carry_next`` (sent by
        tile ``j + 1``'s backward once its reduce-scatter is done) orders tile ``j``'s
        gather after it. A floating ``x`` is passed on as ``x_next`` once ``y_j`` exists,
        so the backward carries one running ``dx`` sum instead of ``k`` terms; an integer
        ``x`` (an ``Embedding``'s ids) has no gradient and is passed on as is.

        ``kbuf`` is the kernel's anchor (float32 ``[shard_elements]``; None in a
        forward-only pass), passed through every tile: its gradient is one buffer of the
        kernel's shard shape that the tiles' backwards fill in turn, each writing its
        reduced column piece in place (``TensorStridedSliceUpdate`` reuses the buffer it
        alone holds), so the unit's gradient shard is never held twice (a split of the
        anchor would concatenate the pieces into a second copy).

        ``y_j`` keeps its logits as ``_keras_logits`` when the activation set them (a
        sigmoid: Keras's crossentropy reads them,
        :func:`~zero_runtime.stage3.gather.keras_logits_positions`): they are an output
        of the tile's use too, differentiated with ``y_j`` in its backward.

        ``done`` (tile 0 only; float32 scalar, the step's done anchor, None without an
        update during backward): tile 0's backward runs last and completes the kernel's
        gradient shard; when the runner's update during backward takes it
        (:meth:`~zero_runtime.stage3.gather.UnitRunner.update_now`: the kernel read by
        this use alone), the buffer goes to the host update there and then and the
        anchor gets no gradient, so no tiled kernel's gradient shard waits on the device
        for the step's end (the device working set is then a tile plus activations,
        whatever the model's size).
        """
        is_float = x.dtype.is_floating
        if kbuf is None:  # forward only
            y = self._call(x, self._views(j, [_dep(x), carry]))
            with tf.control_dependencies([y]):
                return y, tf.identity(x) if is_float else x, _token(y), None

        kernel = self.plan.kernel
        start, size = self.plan.bounds[j]
        moved = [kernel.rows, *kernel.shape[1:]]  # (R, *rest): the shard's layout
        begin, end = [0] * len(moved), list(moved)
        begin[self.plan.kernel_axis], end[self.plan.kernel_axis] = start, start + size
        piece_shape = list(moved)  # (R, ..., n_j, ...): tile j's piece of the shard
        piece_shape[self.plan.kernel_axis] = size

        done_in = [] if done is None else [done]
        box = {}  # trace-time: the positions of y's logits (gather.keras_logits_positions)

        @tf.custom_gradient
        def use(inp, c, k, *_other_anchors_and_done):
            y = self._call(inp, self._views(j, [_dep(inp), c]))
            outs = [y, _token(y), tf.identity(k)]
            if is_float:
                with tf.control_dependencies([y]):
                    outs.append(tf.identity(inp))
            box["logits"] = keras_logits_positions([y])  # [0] or []: y's logits last
            outs += with_keras_logits([y], box["logits"])[1:]

            def grad(dy, d_carry, d_kbuf, *rest):
                d_passed = rest[0] if is_float else None
                d_logits = [
                    tf.zeros_like(outs[-1]) if d is None else d for d in rest[int(is_float) :]
                ]
                dy = tf.zeros_like(y) if dy is None else dy
                deps = [_dep(t) for t in (dy, d_carry, d_passed, *d_logits) if t is not None]
                views = self._views(j, deps)
                sources = [*views, inp] if is_float else list(views)
                with tf.GradientTape() as tape:
                    tape.watch(sources)
                    y2 = self._call(inp, views)
                gs = tape.gradient(
                    with_keras_logits([y2], box["logits"]),
                    sources,
                    output_gradients=[dy, *d_logits],
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
                gs = [tf.convert_to_tensor(g) for g in gs]  # [dW_j, *d_others, (dx_j)]
                shard = self._reduce_scatter(j, gs[: len(views)])
                sizes = [math.prod(piece_shape)] + [v.shard_elements for v, _ in self.plan.others]
                reduced = tf.split(shard, sizes)
                if d_kbuf is None or d_kbuf.shape.rank == 0:  # the first tile in backward
                    # (the scalar anchor's zero gradient, or none): the buffer, made now
                    d_kbuf = tf.fill([math.prod(moved)], _token(dy)[0] * 0.0)
                filled = tf.raw_ops.TensorStridedSliceUpdate(
                    input=tf.reshape(d_kbuf, moved),
                    begin=begin,
                    end=end,
                    strides=[1] * len(moved),
                    value=tf.reshape(reduced[0], piece_shape),
                )
                dx = None
                with tf.control_dependencies([shard]):  # the previous tile's gather after
                    if is_float:
                        dx = tf.identity(gs[-1] if d_passed is None else gs[-1] + d_passed)
                    d_c = _token(shard)
                # Copies: a split piece would alias the tile's whole reduced buffer, and the
                # bias's gradient (summed over the tiles) is aggregated only at the end of
                # the backward, which kept every tile's buffer alive (measured: +4 bytes
                # per tiled parameter at the step's peak).
                others_g = [tf.gather(tf.reshape(r, [1, -1]), 0) for r in reduced[1:]]
                d_k = tf.reshape(filled, [-1])
                if not done_in:
                    return (dx, d_c, d_k, *others_g)
                token = self.runner.update_now(self.replica, (kernel,), d_k)
                if token is None:  # read by another use too: summed after the backward
                    return (dx, d_c, d_k, *others_g, None)
                return (dx, d_c, None, *others_g, token)

            return outs, grad

        outs = use(x, carry, kbuf, *others, *done_in)
        if box["logits"]:
            outs[0]._keras_logits = outs[-1]  # noqa: SLF001  (Keras's own attribute)
        return outs[0], outs[3] if is_float else x, outs[1], outs[2]

    def _call(self, x: tf.Tensor, views: list) -> tf.Tensor:
        """The layer's own call with the tile's views in place of its weights.

        The views are set with ``StatelessScope.add_update`` (no shape check): a tile's
        kernel is narrower than the variable, which the scope's constructor refuses.
        """
        plan = self.plan
        with keras.StatelessScope() as scope:
            scope.add_update((plan.kernel, views[0]))
            for (v, _), w in zip(plan.others, views[1:]):
                scope.add_update((v, w))
            return self.unit.call(x, **self.kwargs)

    def _views(self, j: int, deps: list) -> list[tf.Tensor]:
        """Tile ``j``'s kernel ``W_j`` (its logical shape with ``n_j`` columns) and the
        other variables' tile slices, on this replica, read after ``deps``."""
        plan = self.plan
        kernel = plan.kernel
        start, size = plan.bounds[j]
        rest = list(kernel.shape[1:])
        rest[plan.kernel_axis - 1] = size
        device = kernel.device_shard(self.replica)
        if device is not None:  # a device-tier shard: sliced in the graph, after ``dep``
            with tf.control_dependencies(deps):
                rows = tf.reshape(device.read_value(), [kernel.rows, *kernel.shape[1:]])
            piece = tf.reshape(_slice(rows, plan.kernel_axis, start, size), [-1])
        else:  # pool pages (host, NVMe): the host cuts the slice
            schedule = self.runner.schedule  # NVMe: prefetch the next reads (schedule.py)
            prefetch = schedule.read(self.replica, (kernel,)) if schedule else None
            read = (kernel, self.replica, plan.kernel_axis, start, size, prefetch)
            piece = host_function(
                functools.partial(_read_tile, *read),
                [*deps, not_foldable()],  # (unit_comm.not_foldable)
                tf.float32,
                stateful=False,  # ordered by ``dep`` only (see unit_comm's docstring)
                name="zero3_tile_shard",
            )
        piece.set_shape([kernel.rows * math.prod(rest)])  # (R * n_j * ...,)
        full = comm.all_gather_flat(piece, self.runner.group)  # (N * R * n_j * ...,)
        w = tf.reshape(full, [kernel.padded_rows, *rest])[: kernel.shape[0]]  # (D_0, *rest)
        views = [w]
        if plan.others:
            variables = tuple(v for v, _ in plan.others)
            whole = self.runner.gather_variables(variables, self.replica, _dep(w))
            for (_, axis), value in zip(plan.others, whole):
                views.append(value if axis is None else _slice(value, axis, start, size))
        return views

    def _reduce_scatter(self, j: int, grads: list) -> tf.Tensor:
        """One reduce-scatter of tile ``j``'s kernel gradient (laid out like the kernel's
        shards, ``(N, R * n_j * ...)``) and the other variables' full gradients (a sliced
        bias's tile gradient zero-padded to its full length)."""
        plan = self.plan
        start, size = plan.bounds[j]
        geoms: list = [_TileGeometry.of(plan.kernel, plan.kernel_axis, size)]
        full = [grads[0]]
        for (v, axis), g in zip(plan.others, grads[1:]):
            if axis is not None:
                g = _pad(g, axis, start, int(v.shape[axis]))
            geoms.append(v)
            full.append(g)
        return reduce_scatter_variables(geoms, full, self.runner.group, raw=True)


@dataclasses.dataclass(frozen=True)
class _TileGeometry:
    """The shard geometry of a kernel tile, as :func:`reduce_scatter_variables` reads a
    ShardedVariable's: rows as the kernel's, ``n_j`` columns on the tiled axis."""

    shape: tuple[int, ...]
    num_shards: int
    rows: int
    shard_dim: int = 0

    @classmethod
    def of(cls, kernel, axis: int, size: int) -> _TileGeometry:
        shape = list(kernel.shape)
        shape[axis] = size
        return cls(tuple(shape), kernel.num_shards, kernel.rows)

    @property
    def _moved_shape(self) -> tuple[int, ...]:
        return self.shape

    @property
    def padded_rows(self) -> int:
        return self.num_shards * self.rows

    @property
    def shard_elements(self) -> int:
        return self.rows * math.prod(self.shape[1:])


def _read_tile(
    kernel, replica: int, axis: int, start: int, size: int, prefetch=None, *_
) -> np.ndarray:
    """Host side of a tile's gather: the column slice of this replica's kernel shard.
    ``prefetch``: None, or the read's schedule hook, run first (as ``gather._read_shards``)."""
    if prefetch is not None:
        prefetch()
    # Only the tile's columns are copied from the shard's pages (a copy of the whole
    # shard per tile copied it once per tile: 4 times for a 4-tile kernel).
    return kernel.read_shard_slice(replica, axis, start, size)


def _slice(value: tf.Tensor, axis: int, start: int, size: int) -> tf.Tensor:
    """``value``'s ``[start, start + size)`` along ``axis`` (negative allowed)."""
    rank = len(value.shape)
    begin, sizes = [0] * rank, [-1] * rank
    begin[axis % rank], sizes[axis % rank] = start, size
    return tf.slice(value, begin, sizes)


def _pad(g: tf.Tensor, axis: int, start: int, full: int) -> tf.Tensor:
    """``g`` zero-padded along ``axis`` to ``full``, its values at ``[start, ...)``."""
    rank = len(g.shape)
    pads = [[0, 0] for _ in range(rank)]
    pads[axis % rank] = [start, full - start - int(g.shape[axis])]
    return tf.pad(g, pads)


def _dep(t: tf.Tensor) -> tf.Tensor:
    """One element of ``t`` (a data dependency for a host read)."""
    return tf.reshape(t, [-1])[:1]


def _token(t: tf.Tensor) -> tf.Tensor:
    """One element of ``t`` as float32 ``[1]`` (a tile's ordering carry)."""
    return tf.cast(_dep(t), tf.float32)
