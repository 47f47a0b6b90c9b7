"""Put first on ``PYTHONPATH`` by ``commgate capture``: every Python process the job's launcher starts runs
this at startup. A rank of a captured job (``RANK`` and ``COMMGATE_CAPTURE`` set) gets its capture set up
(``commgate.run.external.activate``). A process of the job without ``RANK`` (one ``torch.multiprocessing.spawn``
started, given its rank as an argument) is set up when it calls ``init_process_group`` with a ``rank``
(``commgate.run.external.arm``, installed as torch's ``distributed_c10d`` is imported: nothing of commgate or
torch is imported before that). A ``sitecustomize`` further down the path (a distribution's, a virtual
environment's) runs after it."""

import importlib
import importlib.abc
import importlib.util
import os
import sys
from typing import Any

C10D = "torch.distributed.distributed_c10d"


class _Armed(importlib.abc.Loader):
    """``distributed_c10d``'s own loader, with ``init_process_group`` wrapped once the module has run."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        from commgate.run.external import arm

        arm(module)


class _AtInit(importlib.abc.MetaPathFinder):
    """Finds ``distributed_c10d`` as the other finders do, its loader wrapped (``_Armed``); then steps aside."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != C10D:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Armed(spec.loader)
        return spec


if os.environ.get("COMMGATE_CAPTURE"):
    if "RANK" in os.environ:
        from commgate.run.external import activate

        activate()
    elif C10D not in sys.modules:
        sys.meta_path.insert(0, _AtInit())


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
