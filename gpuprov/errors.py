"""Errors the CLI maps to exit codes without a traceback (see DESIGN.md: exit codes)."""


class GpuprovError(Exception):
    """The user's input cannot be served: bad spec, unknown name, nothing fits. Exit 2."""

    exit_code = 2


def clip(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, cut at a word boundary with '...' marking the cut (a message
    never ends mid-word); a single word longer than the room is cut where it must be."""
    if len(text) <= limit:
        return text
    cut = text[: max(0, limit - 3)]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:(") + "..."


class DriftError(GpuprovError):
    """A check found a difference or a health check failed. Exit 1."""

    exit_code = 1
