"""Renderers: pure functions Plan -> {relative path: file text}. They read the plan, decide nothing.

Each renderer returns paths relative to its own bundle folder (terraform/, ansible/, launch/);
the bundle writer places them. Files ending in `.sh` or `.sbatch` are written executable.
"""

from __future__ import annotations

RenderedFiles = dict[str, str]

EXECUTABLE_SUFFIXES = (".sh", ".sbatch")
