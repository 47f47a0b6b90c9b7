"""Put first on ``PYTHONPATH`` by ``commgate capture``: every Python process the job's launcher starts runs
this at startup. A rank of a captured job (``RANK`` and ``COMMGATE_CAPTURE`` set) gets its capture set up
(``commgate.run.external.activate``); any other process only pays for reading two variables. A
``sitecustomize`` further down the path (a distribution's, a virtual environment's) runs after it."""

import importlib
import os
import sys

if os.environ.get("COMMGATE_CAPTURE") and "RANK" in os.environ:
    from commgate.run.external import activate

    activate()


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    mine = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        importlib.import_module("sitecustomize")
    except Exception as exc:  # as Python's site.py says a failing sitecustomize, not a missing one
        if not (isinstance(exc, ImportError) and exc.name == "sitecustomize"):
            said = f"{type(exc).__name__}: {exc}"
            print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{said}", file=sys.stderr)
    finally:
        sys.path[:] = saved
        if mine is not None:
            sys.modules["sitecustomize"] = mine


_chain()
