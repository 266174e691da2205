"""Page checksums: CRC-32C (Castagnoli) of a page's payload.

Every page written to the NVMe tier records the CRC-32C of its payload, and every read
checks it (a mismatch is :class:`~zero_runtime.memory.errors.PageChecksumError`).
CRC-32C is the checksum of iSCSI (RFC 3720, appendix B.4), ext4 metadata and NVMe's own
end-to-end protection; x86 (SSE 4.2 ``crc32``) and ARMv8 compute it in hardware.

It comes from the ``crc32c`` package on PyPI (ICRAR; LGPL-2.1-or-later, used unmodified
as an installed dependency, never vendored). Measured on this machine
(``bench/bench_paging.py``, ``checksum`` in ``bench/results/paging.json``): 2.7-17 GB/s
per thread on 4 MiB pages with the hardware instruction, depending on the machine's
load, against 0.6-1.5 GB/s for ``zlib.crc32`` (CRC-32), which also did not scale with
threads. ``google-crc32c`` was as
fast on ``bytes`` but accepts only read-only buffers, so checking a page in its host slot
would need a copy of the page first. ``crc32c`` releases the GIL on large buffers, so the
I/O threads checksum pages in parallel.
"""

from __future__ import annotations

import crc32c

#: The checksum recorded per NVMe page (named in error messages and reports).
ALGORITHM = "crc32c"

#: True when the package computes CRC-32C with the CPU's instruction (else in software,
#: about 10x slower; still correct).
HARDWARE = bool(getattr(crc32c, "hardware_based", False))


def page_checksum(data: memoryview | bytes | bytearray) -> int:
    """CRC-32C of ``data`` (any C-contiguous buffer, read-only or writable).

    Args:
        data: the page's payload (bytes), e.g. a memoryview of its host slot.

    Returns:
        The checksum as an unsigned 32-bit int (``0xE3069283`` for ``b"123456789"``,
        the check value of RFC 3720's CRC-32C).
    """
    return crc32c.crc32c(data)
