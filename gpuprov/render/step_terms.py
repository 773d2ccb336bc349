"""The step by kind of work, as `plan`, the report and `explain` print it."""

from __future__ import annotations

STEP_TERM_WORDS = {"gemm": "GEMMs", "attention": "attention", "memory_bound": "memory-bound ops",
                   "launch": "kernel launches", "exposed_comm": "exposed communication", "optimizer": "optimizer step",
                   "pipeline_bubble": "pipeline bubble"}


def step_terms_text(terms: dict[str, float]) -> str:
    """'GEMMs 3.10 s (70%) + attention ...' for the step's non-zero terms, in STEP_TERMS order."""
    total = sum(terms.values()) or 1.0
    return " + ".join(f"{STEP_TERM_WORDS.get(k, k)} {v:,.2f} s ({v / total:.0%})" for k, v in terms.items() if v > 0)
