"""The true global norm of a stage-3 custom loop's gradients (``tf.clip_by_global_norm``).

At stage 3 a user's ``tape.gradient(loss, model.trainable_variables)`` returns, for each
sharded variable, the replica's *gradient shard*: its rows of the reduced gradient ``G``
(summed over replicas), float32 ``[shard_elements]``, zero-padded
(:mod:`zero_runtime.sharded_variable`). TensorFlow's ``tf.clip_by_global_norm`` and
``tf.linalg.global_norm`` over those would give the norm of one replica's shards. Inside a
stage-3 user step they give instead the norm of ``G``:

    ``||G||^2 = sum over replicas of this replica's shards' sum of squares
    + the whole tensors' sum of squares, counted once``

(one all-reduce of a float32 scalar,
:func:`zero_runtime.comm.all_reduce_sum_of_squares`; padding is zero and adds nothing).
A *whole* tensor is any other entry of the list: the same on every replica when it is a
gradient the runtime already all-reduced (a row-paged embedding table's touched rows,
``(K, C)``), counted once. This is the clipping of DeepSpeed and FSDP (the reduced
gradient's norm) and of Keras on one device; ``MirroredStrategy`` instead clips each
replica's local gradient (stages 0-2 keep that: no shards exist there).

How shards are told apart. Each use of a unit returns its reduced shard as the gradient
of the variable's scalar *anchor* (:mod:`zero_runtime.stage3.gather`). In a user step,
the uses read :func:`recorded_anchor` of the anchor the tape watches: an identity whose
gradient function receives the variable's gradient summed over the uses of one model
call and records it (by graph and tensor name) before returning it; so
``tape.gradient`` returns recorded tensors. What TensorFlow builds from recorded shards
is a shard too when it is one of: the sum of shards (``tf.add_n``, ``a + b``, ``a - b``,
the tape's own sum over several model calls), ``-a``, a shard times or divided by a
scalar, an identity or float cast; ``tf.clip_by_global_norm``'s own outputs therefore are.
Any other tensor computed from shards (a reshape, ``tf.clip_by_value``, a concat) is
refused: its norm could be neither. Everything without a recorded shard in its inputs
goes to TensorFlow's own function, unchanged.

How the calls are intercepted. ``tf.experimental.dispatch_for_api`` dispatches on
``tf.ExtensionType`` arguments only (a gradient shard is a plain ``tf.Tensor``), and the
older global dispatchers run only when the op raised. So :func:`install` (at the first
stage-3 user step) replaces the attributes ``tf.clip_by_global_norm``,
``tf.linalg.global_norm`` and their ``tf.compat.v1`` names with wrappers that keep
TensorFlow's signature and docstring (``functools.wraps``) and call the original
(``clip_by_global_norm`` with ``use_norm=`` the true norm). Not reached:
``tensorflow.python.ops.clip_ops`` imported directly, a name bound with
``from tensorflow import clip_by_global_norm`` before the first stage-3 user step (both
refused at ``apply_gradients`` when they scaled shards: :func:`refuse_local_norm`), and
a norm computed by hand (``tf.norm`` of each shard): that one is local.
"""

from __future__ import annotations

import collections
import collections.abc
import functools
import re
import threading
import weakref

import tensorflow as tf
from tensorflow.python.framework import indexed_slices

from zero_runtime import comm
from zero_runtime.comm.buckets import replica_barrier

#: graph -> {tensor name: the CollectiveGroup of its replicas}: the gradient shards the
#: step's tapes returned in that graph (keys weak: a graph's record goes with it).
_RECORDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()

#: Ops whose output is a shard when every input is one (the sum of shards; TF's op names).
_SUMS = frozenset({"AddN", "AddV2", "Add", "Sub", "Neg", "Identity", "Cast"})
#: Ops ``shard * scalar`` / ``shard / scalar``: the operand positions a shard may take.
_SCALINGS = {"Mul": (0, 1), "MulNoNan": (0, 1), "RealDiv": (0,), "Div": (0,), "DivNoNan": (0,)}
#: Depth of the sums and scalings followed from a tensor back to recorded shards.
_MAX_DEPTH = 64
#: Ops searched above a tensor for a recorded shard it was computed from (per tensor).
_SEARCH_OPS = 64
#: The name of the op each gradient shard a user's tape returns comes from (its identity).
SHARD_OP_NAME = "zero3_gradient_shard"
#: TensorFlow's shape-mismatch messages (an elementwise op, an assign) at trace time.
_SHAPE_MISMATCH = re.compile(
    r"Dimensions must be equal|Shapes must be equal rank|are incompatible|Incompatible shapes"
)
#: The name of the op ``tensorflow.python.ops.clip_ops.global_norm`` returns.
_TF_NORM_OP = re.compile(r"global_norm(_\d+)?")


def recorded_anchor(anchor: tf.Tensor, group) -> tf.Tensor:
    """The anchor a user step's uses read in place of ``anchor`` (the one the tape watches).

    An identity (float32 scalar) whose gradient function records its incoming gradient
    (the variable's reduced gradient shard summed over the uses that read this tensor,
    float32 ``[shard_elements]``) as a shard of ``group``'s replicas, and returns it as
    ``anchor``'s gradient. Installs the ``tf`` wrappers (:func:`install`).

    Args:
        anchor: the variable's float32 scalar anchor, watched by the user's tapes.
        group: the engine's :class:`~zero_runtime.comm.CollectiveGroup`.

    Returns:
        A float32 scalar (0.0) for the uses to read.
    """
    install()

    @tf.custom_gradient
    def mark(a):
        def grad(dy):
            shard = tf.identity(dy, name=SHARD_OP_NAME)
            _record(shard, group)
            return shard

        return tf.identity(a), grad

    return mark(anchor)


def _record(t: tf.Tensor, group) -> None:
    graph = getattr(t, "graph", None)
    if graph is None:  # eager: a user step runs inside tf.function only
        return
    with _LOCK:
        _RECORDED.setdefault(graph, {})[t.name] = group


def _recorded_in(tensors: list) -> dict:
    """The recorded shards of the graph the first graph tensor of ``tensors`` is in."""
    for t in tensors:
        graph = getattr(t, "graph", None) if tf.is_tensor(t) else None
        if graph is not None:
            return _RECORDED.get(graph, {})
    return {}


def _shard_group(t: tf.Tensor, recorded: dict, memo: dict, depth: int = 0):
    """The CollectiveGroup when ``t`` is a gradient shard (recorded, or a sum / scaling of
    shards: the module docstring), else None."""
    name = t.name
    if name in memo:
        return memo[name]
    group = recorded.get(name)
    op = t.op
    if group is None and depth < _MAX_DEPTH:
        ins = list(op.inputs)
        if op.type in _SUMS and ins and (op.type != "Cast" or t.dtype.is_floating):
            groups = [_shard_group(i, recorded, memo, depth + 1) for i in ins]
            group = groups[0] if all(g is not None for g in groups) else None
        elif op.type == "IdentityN":
            group = _shard_group(ins[t.value_index], recorded, memo, depth + 1)
        elif op.type in _SCALINGS and len(ins) == 2:
            for k in _SCALINGS[op.type]:
                if ins[1 - k].shape.rank == 0:
                    group = group or _shard_group(ins[k], recorded, memo, depth + 1)
    memo[name] = group
    return group


def _shard_above(t: tf.Tensor, recorded: dict) -> str | None:
    """The name of a recorded shard among the inputs of the ops above ``t`` (a
    breadth-first search of at most :data:`_SEARCH_OPS` ops), else None."""
    seen, todo = set(), collections.deque([t.op])
    while todo and len(seen) < _SEARCH_OPS:
        op = todo.popleft()
        if op.name in seen:
            continue
        seen.add(op.name)
        for i in op.inputs:
            if i.name in recorded:
                return i.name
            todo.append(i.op)
    return None


def true_global_norm(t_list, name: str | None = None) -> tf.Tensor | None:
    """The global norm of ``t_list`` where some entries are gradient shards, else None.

    Args:
        t_list: a sequence of tensors, ``tf.IndexedSlices`` or None (None ignored), as
            ``tf.linalg.global_norm`` takes.
        name: the name scope (default ``"global_norm"``).

    Returns:
        float32 scalar ``sqrt(||shards of every replica||^2 + ||whole entries||^2)``
        (the module docstring), the same on every replica; None when ``t_list`` holds no
        recorded gradient shard (or is not a sequence): the caller runs TensorFlow's.

    Raises:
        ValueError: an entry computed from gradient shards by something other than a
            sum or a scaling (the module docstring), naming it and the fix.
        RuntimeError: called outside replica context (from the all-reduce).
    """
    if isinstance(t_list, str) or not isinstance(t_list, collections.abc.Sequence):
        return None
    entries = [t.values if isinstance(t, indexed_slices.IndexedSlices) else t for t in t_list]
    recorded = _recorded_in([t for t in entries if t is not None])
    if not recorded:
        return None
    values = [tf.convert_to_tensor(t) for t in entries if t is not None]
    memo, shards, wholes, group = {}, [], [], None
    for v in values:
        g = _shard_group(v, recorded, memo)
        if g is not None:
            shards.append(v)
            group = group or g
            continue
        source = _shard_above(v, recorded)
        if source is not None:
            raise ValueError(
                f"stage 3: {v.name!r} ({v.op.type}) passed to the global norm is computed "
                f"from the gradient shard {source!r} by an operation that is neither a sum "
                "of shards nor a shard times a scalar, so its norm across replicas is not "
                "known. Pass the gradients tape.gradient returned (or their sums / "
                "scalings), or clip in the optimizer: keras.optimizers.Adam(..., "
                "global_clipnorm=C)"
            )
        wholes.append(v)
    if not shards:
        return None
    with tf.name_scope(name or "global_norm"):
        # Every replica's backward traced before any replica's collective (buckets.py).
        replica_barrier()
        squares = comm.all_reduce_sum_of_squares(shards, group)  # () float32
        if wholes:
            squares += tf.add_n([tf.reduce_sum(tf.square(tf.cast(w, tf.float32))) for w in wholes])
        return tf.sqrt(squares, name="true_global_norm")


def refuse_local_norm(grads: list) -> None:
    """Raise when gradient shards passed to ``apply_gradients`` were scaled by
    TensorFlow's own global norm of shards (its ``clip_ops`` called past the wrappers:
    this replica's shard norm, not the step's).

    Args:
        grads: the gradient tensors given to ``apply_gradients`` (graph tensors).

    Raises:
        ValueError: naming the norm op and the fix.
    """
    recorded = _recorded_in(grads)
    if not recorded:
        return
    seen, todo = set(), collections.deque(g.op for g in grads)
    while todo and len(seen) < _SEARCH_OPS * max(1, len(grads)):
        op = todo.popleft()
        if op.name in seen:
            continue
        seen.add(op.name)
        last = op.name.rsplit("/", 1)[-1]
        if (
            op.type == "Sqrt"
            and _TF_NORM_OP.fullmatch(last)
            and _shard_above(op.outputs[0], recorded)
        ):
            raise ValueError(
                f"stage 3: the gradients passed to apply_gradients were scaled by "
                f"{op.name!r}, TensorFlow's own global norm of gradient shards (its "
                "clip_ops called directly, or a name bound before the first stage-3 "
                "step): that is this replica's shard norm, not the step's gradient norm. "
                "Call tf.clip_by_global_norm / tf.linalg.global_norm through the tf "
                "module (at stage 3 they give the norm over every replica's shards), or "
                "clip in the optimizer: keras.optimizers.Adam(..., global_clipnorm=C)"
            )
        todo.extend(t.op for t in op.inputs)


# -- the tf wrappers ------------------------------------------------------------------------
def _wrap_global_norm(original):
    @functools.wraps(original)
    def global_norm(t_list, name=None):
        norm = true_global_norm(t_list, name)
        return original(t_list, name=name) if norm is None else norm

    global_norm._zero_true_norm = True  # noqa: SLF001
    return global_norm


def _wrap_clip(original):
    @functools.wraps(original)
    def clip_by_global_norm(t_list, clip_norm, use_norm=None, name=None):
        if use_norm is None:
            use_norm = true_global_norm(t_list, name)
        return original(t_list, clip_norm, use_norm=use_norm, name=name)

    clip_by_global_norm._zero_true_norm = True  # noqa: SLF001
    return clip_by_global_norm


def _targets() -> list:
    """``(module, attribute, wrap)`` of every name :func:`install` replaces."""
    v1 = tf.compat.v1
    return [
        (tf, "clip_by_global_norm", _wrap_clip),
        (tf.linalg, "global_norm", _wrap_global_norm),
        (v1, "clip_by_global_norm", _wrap_clip),
        (v1, "global_norm", _wrap_global_norm),
        (v1.linalg, "global_norm", _wrap_global_norm),
    ]


def install() -> None:
    """Replace ``tf.clip_by_global_norm``, ``tf.linalg.global_norm`` and their
    ``tf.compat.v1`` names by the wrappers (the module docstring); idempotent.

    Outside a stage-3 user step, and for lists without gradient shards, the wrappers
    call TensorFlow's function with the same arguments and return its result.
    """
    with _LOCK:
        for module, attr, wrap in _targets():
            current = getattr(module, attr, None)
            if current is not None and not getattr(current, "_zero_true_norm", False):
                setattr(module, attr, wrap(current))


def explain_shape_error(exc: BaseException) -> ValueError | None:
    """The error to raise instead of ``exc`` when it is TensorFlow's shape mismatch
    between a gradient shard and another tensor, traced in a stage-3 user step (an
    accumulator of the variable's whole shape, ``tf.zeros_like(v)``, plus a shard);
    None for any other error.

    The shard is float32 ``[shard_elements]`` (the module docstring), the whole-shaped
    tensor under ``MirroredStrategy`` would have matched the replica's whole gradient.
    ``ZeroInfinityStrategy.run`` raises the result ``from exc``.
    """
    text = str(exc)
    if SHARD_OP_NAME not in text or not _SHAPE_MISMATCH.search(text):
        return None
    return ValueError(
        "stage 3: tape.gradient returns each sharded variable's gradient shard (float32 "
        "[shard_elements], this replica's rows of the reduced gradient), and the step "
        "combined one with a tensor of another shape, such as an accumulator made with "
        "tf.zeros_like(v) over model.trainable_variables (the variable's whole shape). "
        "Let the runtime accumulate: ZeroConfig(gradient_accumulation_steps=N), and call "
        "optimizer.apply_gradients on every micro-batch's gradients, each micro-batch's "
        "loss averaged over its own examples (it averages the N micro-batches' shards "
        "and updates once every N calls; or keep accumulators shaped like the gradients, "
        f"tf.zeros_like(g)). TensorFlow's error: {text}"
    )
