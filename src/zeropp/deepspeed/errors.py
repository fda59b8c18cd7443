"""The engine's own exception type (here so engine.py and its mixins share it)."""


class EngineAssertionError(ValueError, AssertionError):
    """A misuse DeepSpeed reports with an assert (a non-scalar loss to scale, ranks
    saving under different checkpoint tags, step() inside a no_sync context): a
    ValueError, and an AssertionError for code written against DeepSpeed."""
