"""Continue ``fit``'s data where a mid-epoch backup stopped: the same batches follow.

Keras's ``fit`` builds its batch iterator from ``strategy.experimental_distribute_dataset``
before any callback runs, then calls ``iter()`` on the distributed dataset at the start
of an epoch (``keras/src/trainers/epoch_iterator.py``: a new iterator every epoch without
``steps_per_epoch``, one kept across epochs with it). ``ZeroInfinityStrategy`` returns its
distributed datasets as :class:`ResumableDistributedDataset` (TensorFlow's
``DistributedDataset`` with only ``__iter__`` added). ``ZeroBackupAndRestore`` calls
:meth:`DataResume.watch` at ``fit`` start: the next ``iter()`` of one of them binds it as
``fit``'s training data; each later ``iter()`` of it is counted (:attr:`DataResume.iterators`,
so the callback knows how many batches the current iterator has given). After a backup
taken ``k`` batches into its iterator, at batch ``b`` of its epoch, the bound dataset's
first iterator is ``dataset.skip(k)`` (:meth:`DataResume.first_dataset`; the dataset
itself when the backup was taken at the last batch of an epoch of data that is not
``repeat()``-ed, ``k`` = the epoch's batches: Keras starts the next epoch on a new
iterator):

- a dataset Keras knows the length of, without ``steps_per_epoch`` (arrays, a finite
  ``tf.data.Dataset``; a new iterator per epoch, so ``k == b``): the skipped iterator ends
  where the epoch ends (Keras's loop stops when it runs out; its "ran out of data" note is
  silenced by the callback), and the next epochs start from the beginning as before;
- an endless dataset with ``steps_per_epoch`` (``repeat()``; one iterator for the whole
  run, ``k`` = the batches since ``fit``'s first step): the resumed epoch then runs a whole
  ``steps_per_epoch`` (Keras's loop cannot be shortened), so the later epochs end ``b``
  batches later than the uninterrupted run's, and the callback stops ``fit`` after the
  run's total (``epochs x steps_per_epoch``) steps: the same batches, the same steps.

One case is taken for the first though it may be the second: an endless dataset whose
length TensorFlow does not know (not a ``repeat()``, e.g. a generator) with
``steps_per_epoch``, backed up exactly at the end of the first epoch of its ``fit``, starts
its data again (``repeat()`` it, or give it its length, to avoid it).

Refused (``NotImplementedError`` naming the fix): a dataset of unknown length without
``steps_per_epoch`` (Keras would take the shorter resumed epoch's length for the next
ones) and a finite dataset that ``steps_per_epoch`` spreads over several epochs. Arrays
with a ``steps_per_epoch`` below their number of batches cannot be told apart from the
first case and are not continued exactly.

Skipping happens before the strategy distributes (and auto-shards) the dataset, so every
worker skips the same global batches. Other distributed datasets, and every dataset when
nothing is watched, iterate exactly as TensorFlow's.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from tensorflow.python.distribute import input_lib

#: ``Dataset.cardinality()`` values (tf.data.INFINITE_CARDINALITY / UNKNOWN_CARDINALITY).
INFINITE, UNKNOWN = -1, -2


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a backup stopped in ``fit``'s data.

    Attributes:
        iterator_batches: batches its iterator had given (``k``).
        epoch_batches: batches of its epoch trained (``b``).
        steps_per_epoch: Keras's steps per epoch (``params['steps']``), or None.
    """

    iterator_batches: int
    epoch_batches: int
    steps_per_epoch: int | None


class DataResume:
    """Binds ``fit``'s training dataset, counts its iterators, and starts the first one
    after a backup's position. One per strategy.

    Attributes:
        iterators: ``iter()`` calls of the bound dataset since :meth:`watch`.
        started_over: the resumed iterator started at its dataset's beginning (the backup
            was taken at an epoch's last batch): its batches count from 0, not from the
            backup's ``iterator_batches`` (the callback reads and clears it).
    """

    def __init__(self) -> None:
        self._watching = False
        self._position: Position | None = None
        self._bound: weakref.ref | None = None
        self.iterators = 0
        self.started_over = False

    def watch(self, position: Position | None = None) -> None:
        """Bind the next ``iter()`` of a resumable dataset; start it at ``position``
        (None: at its beginning)."""
        self._watching = True
        self._position = position
        self._bound = None
        self.iterators = 0
        self.started_over = False

    def clear(self) -> None:
        """Stop watching (``fit`` ended)."""
        self._watching = False
        self._position = None
        self._bound = None

    def dataset_for(self, dist: Any, dataset: tf.data.Dataset) -> tf.data.Dataset | None:
        """The dataset ``dist``'s new iterator should iterate instead of ``dataset``, or
        None (``dataset`` itself); counts the bound dataset's iterators.

        Raises:
            NotImplementedError: the position cannot be continued exactly (the message
                says why and the fix).
        """
        if self._watching and self._bound is None:
            self._bound = weakref.ref(dist)
        if self._bound is None or self._bound() is not dist:
            return None
        self.iterators += 1
        position, self._position = self._position, None
        if position is None:
            return None
        return self.first_dataset(dataset, position)

    def first_dataset(self, dataset: tf.data.Dataset, position: Position) -> tf.data.Dataset:
        """``dataset`` moved on by the batches its iterator had given (module docstring).

        Raises:
            NotImplementedError: a dataset whose epochs Keras measures by running out
                (unknown length, no ``steps_per_epoch``), or a finite dataset whose one
                iterator spans several epochs (``steps_per_epoch`` below its length).
        """
        k, b, per = position.iterator_batches, position.epoch_batches, position.steps_per_epoch
        card = int(dataset.cardinality().numpy())
        if card < 0 and per is None:
            raise NotImplementedError(
                f"resuming fit at batch {b} of an epoch: the dataset's length is unknown and "
                "no steps_per_epoch was given, so Keras measures an epoch by where the data "
                "runs out and would take the resumed (shorter) epoch's length for the next "
                "ones: give the dataset its length (dataset.apply(tf.data.experimental."
                "assert_cardinality(n))) or repeat it and pass steps_per_epoch"
            )
        if card >= 0 and per not in (None, card) and k > b:
            raise NotImplementedError(
                f"resuming fit at batch {b} of an epoch: steps_per_epoch={per} takes one "
                f"iterator of a finite dataset (length {card}) across epochs, which a "
                "resumed run cannot continue exactly: repeat the dataset (dataset.repeat()) "
                "or leave steps_per_epoch out"
            )
        if card != INFINITE and b == 0 and 0 < k == (per if per is not None else card):
            # taken at the last batch of an epoch of finite data (its iterator used up):
            # the next epoch's new iterator starts at the beginning (a skip would leave it
            # empty, and Keras would train the epoch on nothing)
            self.started_over = True
            return dataset
        return dataset.skip(k)


class ResumableDistributedDataset(input_lib.DistributedDataset):
    """TensorFlow's ``DistributedDataset`` whose ``iter()`` asks the strategy's
    :class:`DataResume` where to start. Made by :func:`resumable`; everything else is
    TensorFlow's (a ``tf.function`` argument is rebuilt as the base class)."""

    def __iter__(self):
        source = _SOURCES.get(self)
        if source is not None:
            plan, dataset, distribute = source
            moved = plan.dataset_for(self, dataset)
            if moved is not None:
                return iter(distribute(moved))
        return super().__iter__()


# dist -> (its strategy's plan, the source dataset, how to distribute another dataset)
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def resumable(
    dist: Any,
    plan: DataResume,
    dataset: Any,
    distribute: Callable[[tf.data.Dataset], Any],
) -> Any:
    """``dist`` (what the strategy's ``experimental_distribute_dataset(dataset)`` made)
    as a :class:`ResumableDistributedDataset` following ``plan``; returned as it is when
    it is not exactly TensorFlow's ``DistributedDataset`` or ``dataset`` is not a
    ``tf.data.Dataset``.

    Args:
        dist: the distributed dataset.
        plan: the strategy's :class:`DataResume`.
        dataset: the ``tf.data.Dataset`` it was made from.
        distribute: makes a plain distributed dataset of another ``tf.data.Dataset``
            (same strategy and options).
    """
    if type(dist) is not input_lib.DistributedDataset or not isinstance(dataset, tf.data.Dataset):
        return dist
    dist.__class__ = ResumableDistributedDataset  # adds __iter__ only; no new state
    _SOURCES[dist] = (plan, dataset, distribute)
    return dist
