"""gpuprov: work backwards from a model to a GPU cluster that can train it."""

__version__ = "0.1.0"
