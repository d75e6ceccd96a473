"""Errors the engine raises to every caller once it can serve no more requests."""


class EngineDeadError(RuntimeError):
    """The engine can run no more steps: a step failed, a tensor-parallel worker process died, or the engine was
    shut down. Every request in flight fails with it, and every later request is refused with it."""
