"""Errors the CLI maps to exit codes without a traceback (see DESIGN.md: exit codes)."""


class GpuprovError(Exception):
    """The user's input cannot be served: bad spec, unknown name, nothing fits. Exit 2."""

    exit_code = 2


class DriftError(GpuprovError):
    """A check found a difference or a health check failed. Exit 1."""

    exit_code = 1
