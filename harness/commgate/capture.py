"""What a captured program may call (``commgate capture``, ``COMMGATE_CAPTURE``); nothing when it is not
captured, and torch is not imported here.

    import commgate.capture
    for batch in data:
        commgate.capture.step()   # begins the next step: everything before the first is initialisation
        ...
"""

from __future__ import annotations


def step() -> None:
    """Begin the next training step (from the first call on, the optimizer's steps no longer mark them)."""
    from commgate.run import external

    external.step()
