"""Page access: a tensor's bytes read from and written to its pages where they are.

Terms in :mod:`.page_table`. No page changes state and no use is stamped here (the
core's ``use``/``acquire`` stamp them) (:mod:`.transitions` owns
that): ``read``/``write`` copy a tensor's payloads in place on each page's tier (an NVMe
page through the synchronous staging I/O of :class:`TierTransitions`), and an acquire's
array or device tensor is assembled from pages already brought to its tier. Called
under the pool's lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from zero_runtime.memory.page_table import HOST_STATES, PageState, PageTable, TensorEntry
from zero_runtime.memory.tiers import DeviceTier, HostTier
from zero_runtime.memory.transitions import TierTransitions

if TYPE_CHECKING:
    import tensorflow as tf

S = PageState


class PageAccess:
    """Copies tensor bytes in and out of pages, and assembles acquired tensors.

    Args:
        table: the page table (uses are stamped on the pages: ``touch``).
        device: the device tier.
        host: the host tier.
        transitions: for the synchronous NVMe reads and writes of a page's payload.
    """

    def __init__(
        self,
        table: PageTable,
        device: DeviceTier,
        host: HostTier,
        transitions: TierTransitions,
    ) -> None:
        self._table = table
        self._device = device
        self._host = host
        self._moves = transitions
        self._page_size = host.page_size

    def write(self, entry: TensorEntry, data: np.ndarray) -> None:
        """Overwrite ``entry``'s payloads with ``data`` (1-D uint8 ``[nbytes]``) where
        each page is (its pages are settled)."""
        ps = self._page_size
        for page in entry.pages:
            chunk = data[page.index * ps : page.index * ps + page.payload]
            if page.state is S.ON_DEVICE:
                self._device.put(page.slots["device"], chunk)
            elif page.state in HOST_STATES:
                self._moves.dirty(page)  # a clean page's NVMe copy is stale from here
                self._host.view(page.slots["host"])[: page.payload] = chunk
            else:
                self._moves.write_nvme(page, chunk)

    def read(self, entry: TensorEntry) -> np.ndarray:
        """A copy of ``entry``'s bytes, of its shape and dtype (its pages are settled)."""
        out = np.empty(entry.nbytes, np.uint8)  # (nbytes,)
        ps = self._page_size
        for page in entry.pages:
            chunk = out[page.index * ps : page.index * ps + page.payload]
            if page.state is S.ON_DEVICE:
                self._device.copy_out(page.slots["device"], chunk)
            elif page.state in HOST_STATES:
                chunk[:] = self._host.view(page.slots["host"])[: page.payload]
            else:
                self._moves.read_nvme(page, chunk)
        return out.view(entry.dtype).reshape(entry.shape)

    @staticmethod
    def check_acquire(
        entry: TensorEntry, tier: str, writable: bool, as_pages: bool = False
    ) -> None:
        """Refuse ``writable`` on the device, a tensor acquired on the other tier, and an
        acquire as page views of a tensor acquired as one array (or the reverse).

        Raises:
            ValueError: naming the tensor and tiers (or the two kinds of acquire).
        """
        if writable and tier == "device":
            raise ValueError("acquire(writable=True) is for tier='host'; use write()")
        if entry.acquire_count and entry.acquired_tier != tier:
            raise ValueError(
                f"tensor {entry.tensor_id!r} is acquired on {entry.acquired_tier!r}; release "
                f"it before acquiring on {tier!r}"
            )
        if entry.acquire_count and entry.as_pages != as_pages:
            held, asked = ("acquire", "acquire_pages")
            if entry.as_pages:
                held, asked = asked, held
            raise ValueError(
                f"tensor {entry.tensor_id!r} is acquired by {held}(); release it before "
                f"{asked}() (an array copy and page views of one tensor would overwrite "
                "each other)"
            )

    @staticmethod
    def count_acquire(entry: TensorEntry, tier: str, as_pages: bool = False) -> None:
        """Count one acquire of ``entry`` on ``tier`` (pins its pages until released)."""
        entry.acquire_count += 1
        entry.acquired_tier = tier
        entry.as_pages = as_pages

    def page_views(self, entry: TensorEntry, writable: bool) -> list[np.ndarray]:
        """Host views of an acquired tensor's pages, in page order: 1-D arrays of its
        dtype, page ``i`` holding flat elements ``[i * E, i * E + len(view))`` with
        ``E = page_size // itemsize`` (the last one shorter). No copy, nothing to write
        back: writes through a writable view are in the page."""
        views = []
        for page in entry.pages:
            view = self._host.view(page.slots["host"])[: page.payload].view(entry.dtype)
            view.flags.writeable = writable
            views.append(view)
        return views

    def materialise(self, entry: TensorEntry, tier: str, writable: bool) -> np.ndarray | tf.Tensor:
        """The acquired tensor: a device tensor, or a host array (a view of a one-page
        tensor's slot, else a contiguous copy), kept on the entry until released."""
        if tier == "device":
            return self._device_tensor(entry)
        if entry.acquired is not None:
            if writable:
                entry.acquired.flags.writeable = True
                entry.writable = True
            return entry.acquired
        if not entry.pages:
            arr = np.zeros(entry.shape, entry.dtype)
        elif len(entry.pages) == 1:
            view = self._host.view(entry.pages[0].slots["host"])[: entry.nbytes]
            arr = view.view(entry.dtype).reshape(entry.shape)
        else:
            buf = np.empty(entry.nbytes, np.uint8)  # (nbytes,)
            ps = self._page_size
            for page in entry.pages:
                start = page.index * ps
                buf[start : start + page.payload] = self._host.view(page.slots["host"])[
                    : page.payload
                ]
            arr = buf.view(entry.dtype).reshape(entry.shape)
        arr.flags.writeable = writable
        entry.acquired = arr
        entry.writable = writable
        return arr

    def _device_tensor(self, entry: TensorEntry) -> tf.Tensor:
        tf = self._device._tf  # noqa: SLF001 - the tier's TensorFlow module
        with tf.device(self._device.device_name):
            tf_dtype = tf.as_dtype(entry.dtype)
            if not entry.pages:
                return tf.zeros(entry.shape, tf_dtype)
            parts = [self._device.get(p.slots["device"]) for p in entry.pages]
            flat = parts[0] if len(parts) == 1 else tf.concat(parts, 0)  # (nbytes,) uint8
            itemsize = entry.dtype.itemsize
            if tf_dtype == tf.bool:
                values = tf.cast(flat, tf.bool)
            elif itemsize == 1:
                values = tf.bitcast(flat, tf_dtype)
            else:
                values = tf.bitcast(tf.reshape(flat, [-1, itemsize]), tf_dtype)
            return tf.reshape(values, entry.shape)

    def write_back(self, entry: TensorEntry) -> None:
        """Copy a writable multi-page acquire's array back into its host pages (pinned
        on the host since the acquire)."""
        data = entry.acquired.reshape(-1).view(np.uint8)
        ps = self._page_size
        for page in entry.pages:
            start = page.index * ps
            self._host.view(page.slots["host"])[: page.payload] = data[start : start + page.payload]

    @staticmethod
    def drop_acquire(entry: TensorEntry) -> None:
        """Undo one acquire's count; at the last, forget the array handed out."""
        entry.acquire_count -= 1
        if entry.acquire_count == 0:
            entry.acquired_tier = None
            entry.acquired = None
            entry.as_pages = False
            entry.writable = False
