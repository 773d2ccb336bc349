"""Byte units and how numbers of bytes are written, once for the package."""

from __future__ import annotations

GiB = 2**30  # memory: GPU, host RAM (what drivers and `free` report)
GB = 10**9  # storage and network, as vendors state them
TB = 10**12


def gib(n: int | float, digits: int = 1) -> str:
    """Bytes as GiB, e.g. "69.1 GiB"."""
    return f"{n / GiB:,.{digits}f} GiB"


def tb(n: int | float) -> str:
    """Bytes as TB, e.g. "3.84 TB"."""
    return f"{n / TB:,.2f} TB"
