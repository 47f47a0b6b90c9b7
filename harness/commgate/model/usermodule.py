"""Your own model: its parameter inventory, gradient order and ZeRO-3 module trace, read off the module
itself, built on the meta device (no weights, no memory, no ranks).

The hook (``model: {module: "package.module:build"}`` in a scenario)::

    def build(scenario) -> tuple[torch.nn.Module, Callable[[int], tuple[torch.Tensor, ...]]]:
        '''The model, created on torch's current default device, and a function from a seed to one
        micro-batch's inputs; ``model(*inputs)`` returns the loss.'''

A trainer that builds the job's model itself (Hugging Face's, from a ``config.json``) hands the same
function through its record (``Trainer.model``; the scenario's ``model.builder``) instead of an import string.

commgate calls it under ``torch.device("meta")`` to predict, and on each rank's device to run it
(``commgate.run.workloads.gpt.build``, used by the DDP and ZeRO workloads) under the scheme's engine.
One forward and backward on the meta device then gives what the models of those engines need, as the
engines see it:

* the parameters in registration order (``named_parameters``): shapes, and the module owning each;
* the order in which their gradients become ready (autograd's, through
  ``register_post_accumulate_grad_hook``): DDP's rebuilt buckets and ZeRO's reduction order. Under
  ``model.autocast`` (DDP) that trace runs on fake CPU tensors instead (torch's ``FakeTensorMode``: no
  memory either), since autocast does nothing on the meta device, and on a rank it casts each linear
  layer's weight before its bias, which makes the weight's gradient ready first;
* for ZeRO-3, the hook sequence DeepSpeed's coordinator sees: each module's pre-forward and post-forward
  hook, and its pre-backward and post-backward events placed as DeepSpeed places them (an identity
  autograd function on the module's outputs, fired when their gradient arrives, and one on its inputs,
  fired when theirs is computed; a module whose inputs need no gradient is released at the end of the
  backward; a parameter read in another module's forward becomes that module's, as DeepSpeed's
  ``ZeROOrderedDict`` registers it), activation checkpointing's recompute included, since torch replays
  it on meta tensors too.

* its buffers (``named_buffers``: dtype and size after the cast to the scenario's dtype, which casts the
  floating-point ones; a trainer's model as the trainer builds it, uncast), which DDP broadcasts at
  construction and before every forward;
* which parameters are frozen (``requires_grad`` off): DDP and ZeRO leave them out of the gradient
  reduction and the optimizer, but broadcast (and ZeRO-3 partitions and gathers) them as any other.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import io
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from commgate.core.errors import CommgateError, first_line
from commgate.model.moduletrace import Hook, Module
from commgate.model.scenario import Scenario
from commgate.model.transformer import WIRE_ITEMSIZE, ParamTensor, Shard, dtype_name


@dataclass(frozen=True, slots=True)
class Buffer:
    name: str
    dtype: str
    """commgate's (and the capture's) dtype name: fp32, bf16, int64, bool, ..."""
    numel: int


@dataclass(frozen=True, slots=True)
class Described:
    params: tuple[ParamTensor, ...]
    """Every parameter, in registration order (named after its first owner); ``frozen`` ones included."""
    buffers: tuple[Buffer, ...]
    """Every buffer, in registration order, as the workload holds it."""
    ready: tuple[str, ...]
    """Parameter names in the order their gradients became ready."""
    first: tuple[Hook, ...]
    """The first pass's hooks as DeepSpeed's ZeRO-3 coordinator sees them."""
    later: tuple[Hook, ...]
    """Every later pass's: a parameter read in the forward of a module that does not own it (and was
    not gathered then) is that module's from the first such read on (``register_external_parameter``)."""


class _Exited(BaseException):
    """``os._exit(status)``, called by a user's module while commgate imports or builds it (``_exit_raises``)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


@contextlib.contextmanager
def _exit_raises() -> Iterator[None]:
    """``os._exit`` raises ``_Exited`` meanwhile. A module that called it as commgate imported or built it
    ended commgate's own process with the module's status and no word: ``validate``, ``run`` and pytest's
    collection exited 0 having judged nothing (found by an adversarial pass). And what the module writes to
    descriptor 1 goes to stderr (``_raw_stdout_to_stderr``)."""
    real = os._exit

    def exited(status: int) -> NoReturn:
        raise _Exited(status)

    os._exit = exited
    try:
        with _raw_stdout_to_stderr():
            yield
    finally:
        os._exit = real


@contextlib.contextmanager
def _raw_stdout_to_stderr() -> Iterator[None]:
    """Descriptor 1 is stderr's meanwhile: what a module writes below ``sys.stdout`` (``os.write(1, ...)``, a C
    extension's ``printf``) went into ``commgate predict --json``'s document (found by an adversarial pass).
    C's own buffer is flushed before descriptor 1 is given back, so its lines go to stderr too."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no descriptor 1 to move (a closed or replaced stdout)
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def resolve(spec: str, what: str = "model.module") -> Callable[..., Any]:
    """The callable ``package.module:attribute`` names, imported as ``python -m`` would from the directory
    commgate runs in (the user's repository: its own modules need no install); a one-line ``CommgateError``
    naming ``what`` (the scenario's field) and the fix otherwise."""
    module, _, attr = spec.partition(":")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said), _exit_raises():
            imported = importlib.import_module(module)
    except (SystemExit, _Exited) as exc:  # (argparse's usage error is one): commgate would end with no word
        last = said.getvalue().strip().splitlines()[-1:] or [""]
        printed = f", having printed {last[0][:120]!r}" if last[0] else ""
        status = exc.status if isinstance(exc, _Exited) else exc.code
        how = "called os._exit" if isinstance(exc, _Exited) else "exited"
        raise CommgateError(
            f"{what} {spec!r}: importing {module} {how} (status {status!r}{printed}); a module commgate imports must "
            'not end the process on import: put its command-line code under `if __name__ == "__main__":`'
        ) from None
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        fix = (
            f"; run commgate from the directory that holds {top} (it is {here} now), or add that directory to "
            "PYTHONPATH"
            if exc.name == top
            else ""
        )
        raise CommgateError(f"{what} {spec!r}: cannot be imported ({exc}){fix}") from None
    except ImportError as exc:
        raise CommgateError(f"{what} {spec!r}: cannot be imported ({exc})") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the module's own code failed as it was imported (a BaseException of its own too)
        raise CommgateError(
            f"{what} {spec!r}: importing {module} raised {type(exc).__name__}: {first_line(exc)}; fix the module "
            f"(`python -c 'import {module}'` shows where)"
        ) from None
    sys.stderr.write(said.getvalue())  # what the module printed as it was imported, once it has imported
    try:
        fn: Callable[..., Any] = getattr(imported, attr)
    except AttributeError as exc:
        raise CommgateError(f"{what} {spec!r}: cannot be imported ({exc})") from None
    return fn


def who(scenario: Scenario) -> str:
    """How a message names the model: the scenario's file and its ``model.module``, or the trainer's own
    configuration that built it (a Hugging Face job's ``hf.config``), which is what its user wrote."""
    spec = scenario.model.module
    if scenario.model.builder is None:
        where = f"{scenario.file}: " if scenario.file and not scenario.file.startswith("<") else ""
        return f"{where}model.module {spec!r}"
    source = scenario.trainer_config.get("config")
    return f"{scenario.trainer}.config {source} ({spec})" if source else f"trainer {scenario.trainer}'s model {spec}"


def build(scenario: Scenario, device: Any) -> tuple[Any, Callable[[int], tuple[Any, ...]]]:
    """The user's model and micro-batch function, on ``device`` (a ``torch.device``)."""
    import torch

    assert scenario.model.module is not None
    spec = scenario.model.module
    name = who(scenario)
    with torch.device(device), _exit_raises():
        try:
            out = (scenario.model.builder or resolve(spec))(scenario)
        except CommgateError:
            raise
        except (SystemExit, _Exited) as exc:
            how = f"os._exit({exc.status})" if isinstance(exc, _Exited) else f"sys.exit({exc.code!r})"
            raise CommgateError(
                f"{name}: build(scenario) called {how}; build must return the model and its inputs, not end the process"
            ) from None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a BaseException of the module's own went past every handler
            raise CommgateError(f"{name}: build(scenario) raised {type(exc).__name__}: {exc}") from None
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.nn.Module) and callable(out[1])):
        raise CommgateError(
            f"{name}: build(scenario) must return (torch.nn.Module, "
            f"function from a seed to the inputs), got {_kinds(out)}"
        )
    return out


def _kinds(value: Any) -> str:
    """What ``build`` returned, by type: ``(int, function)``, ``NoneType``."""
    if isinstance(value, tuple):
        return "(" + ", ".join(type(v).__name__ for v in value) + ")"
    return type(value).__name__


def describe(scenario: Scenario) -> Described:
    """What the engines' models need of the user's module (cached per scenario)."""
    return _describe(scenario)


@functools.cache
def _describe(scenario: Scenario) -> Described:
    """The module built and traced on the meta device in this process; what it prints meanwhile is not shown
    (once per scenario and prediction, it would interleave with the run's lines): the ranks build it again,
    and its prints are in their logs."""
    import torch

    with contextlib.redirect_stdout(io.StringIO()):
        model, inputs = build(scenario, torch.device("meta"))
    assert scenario.model.module is not None
    spec = who(scenario)  # (what the messages name)
    # as the workload holds it (commgate.run.workloads.gpt.build): floating-point tensors in the scenario's dtype;
    # a trainer's model as the trainer builds it (Hugging Face's from_config keeps RoPE's inv_freq fp32 in a
    # bf16 model; the ranks check its parameters' dtype is the scenario's)
    if scenario.model.builder is None:
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        model = model.to(dtype=dtypes[scenario.model.dtype])
    params, buffers, modules = _inventory(model, spec)
    with contextlib.redirect_stdout(io.StringIO()):
        ready, events = _trace(model, inputs, spec, scenario.model.autocast)
    if unused := [p.name for p in params if not p.frozen and p.name not in set(ready)]:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        raise CommgateError(
            f"{spec}: {shown} receive{'s' if len(unused) == 1 else ''} no gradient in a forward and backward (on "
            "the meta device): torch's DDP stops at the second step on a trainable parameter never used (without "
            "find_unused_parameters), and commgate does not model what the engines send for one; freeze it "
            "(requires_grad_(False)) or use it in the forward"
        )
    by_name = {p.name: p for p in params}
    first, later = _hooks(events, modules, by_name, {p.name: i for i, p in enumerate(params)})
    return Described(params=params, buffers=buffers, ready=ready, first=first, later=later)


def _inventory(model: Any, spec: str) -> tuple[tuple[ParamTensor, ...], tuple[Buffer, ...], dict[str, Module]]:
    """The module's parameters (frozen ones marked), its buffers and each submodule's own parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = tuple(
        ParamTensor(
            name=n, shape=tuple(p.shape), shard=Shard.REPLICATED, block="layer", layer=0, frozen=not p.requires_grad
        )
        for n, p in model.named_parameters()
    )
    if not params:
        raise CommgateError(f"{spec}: the module has no parameters: nothing to train, nothing to communicate")
    if all(p.frozen for p in params):
        raise CommgateError(f"{spec}: every parameter is frozen (requires_grad off): nothing to train")
    buffers = tuple(Buffer(n, dtype_name(b.dtype), b.numel()) for n, b in model.named_buffers())
    if odd := [b for b in buffers if b.dtype not in WIRE_ITEMSIZE]:
        raise CommgateError(f"{spec}: buffer {odd[0].name} of dtype {odd[0].dtype} is not modelled")
    by_name = {p.name: p for p in params}
    modules: dict[str, Module] = {}
    for mname, mod in model.named_modules():
        own = tuple(names[id(p)] for p in mod._parameters.values() if p is not None and id(p) in names)
        modules[mname] = Module(mname, tuple(by_name[n] for n in own))
    return params, buffers, modules


Event = tuple[Any, ...]
"""(kind, module, backward, recompute) for fetch/release/leftover; ("read", module, parameter)."""


def _trace(
    model: Any, inputs: Callable[[int], tuple[Any, ...]], spec: str, autocast: str | None = None
) -> tuple[tuple[str, ...], list[Event]]:
    """One forward and backward on the meta device with every module hooked as DeepSpeed's ZeRO-3 hooks
    them: the order the gradients became ready in, and the events: (kind, module, backward, recompute) for
    fetch/release/leftover, ("read", module, parameter) for a parameter read in the forward by a module
    that does not own it. Under ``autocast`` (a dtype name), on fake CPU tensors under CPU autocast."""
    import torch

    if autocast is not None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            _to_fake_cpu(model)
            with torch.autocast("cpu", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[autocast]):
                return _trace(model, inputs, spec)
    names = {id(p): n for n, p in model.named_parameters()}
    ready: list[str] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda t, _n=n: ready.append(_n))
        for n, p in model.named_parameters()
        if p.requires_grad
    ]
    hooked = _Hooked(names)
    originals = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        handles.append(mod.register_forward_pre_hook(functools.partial(hooked.pre_forward, name=mname)))
        handles.append(mod.register_forward_hook(functools.partial(hooked.post_forward, name=mname)))
        originals[mname] = (mod, mod._parameters)
        mod._parameters = hooked.reads(mname, mod._parameters)
    try:
        _forward_backward(model, inputs, spec)
    finally:
        for h in handles:
            h.remove()
        for mod, original in originals.values():
            mod._parameters = original
    # modules whose backward began but whose inputs needed no gradient: released with the leftovers
    events = hooked.events + [("leftover", name, True, False) for name in reversed(list(hooked.backward_open))]
    return tuple(ready), events


class _Hooked:
    """The hooks ``_trace`` puts on every module: a module's pre-forward and post-forward, an autograd
    mark on its inputs and outputs whose backward is the module's pre- and post-backward, and its
    ``_parameters`` as a mapping that notes reads from another module's forward (DeepSpeed's
    ``ZeROOrderedDict`` gathers and registers those)."""

    def __init__(self, names: dict[int, str]) -> None:
        import torch

        self.names = names
        self.events: list[Event] = []
        self.stack: list[str] = []
        self.in_backward = False
        self.backward_open: dict[str, bool] = {}
        hooked = self

        class Mark(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, name: str, pre: bool, *ts: Any) -> Any:
                ctx.name, ctx.pre = name, pre
                # fresh tensors, not the inputs: an input returned as-is is a view, and a model that adds into a
                # module's output in place (Falcon's parallel attention) is refused by autograd; free on meta
                out = tuple(t.clone() for t in ts)
                return out if len(out) > 1 else out[0]

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                if ctx.pre:  # the gradient of the module's output arrived: its pre-backward
                    hooked.in_backward = True
                    hooked.events.append(("fetch", ctx.name, True, False))
                    hooked.backward_open[ctx.name] = True
                elif hooked.backward_open.pop(ctx.name, False):  # its inputs' gradient is computed: post-backward
                    hooked.events.append(("release", ctx.name, True, False))
                return (None, None, *grads)

        self.mark_fn = Mark
        self.tensor_type = torch.Tensor

    def mark(self, name: str, pre: bool, value: Any) -> Any:
        tensors = [t for t in _flat(value) if isinstance(t, self.tensor_type) and t.requires_grad]
        if not tensors:
            return value
        marked = self.mark_fn.apply(name, pre, *tensors)  # type: ignore[no-untyped-call]
        marked = marked if isinstance(marked, tuple) else (marked,)
        swap = dict(zip((id(t) for t in tensors), marked, strict=True))
        return _replace(value, swap)

    def pre_forward(self, mod: Any, args: Any, *, name: str) -> Any:
        self.events.append(("fetch", name, self.in_backward, self.in_backward))
        self.stack.append(name)
        return self.mark(name, False, args)

    def post_forward(self, mod: Any, args: Any, output: Any, *, name: str) -> Any:
        self.stack.pop()
        self.events.append(("release", name, self.in_backward, self.in_backward))
        return self.mark(name, True, output)

    def reads(self, owner: str, parameters: dict[str, Any]) -> dict[str, Any]:
        hooked = self

        class Reads(dict):  # type: ignore[type-arg]
            def __getitem__(self, key: str) -> Any:
                value = super().__getitem__(key)
                if value is not None and hooked.stack and hooked.stack[-1] != owner and not hooked.in_backward:
                    hooked.events.append(("read", hooked.stack[-1], hooked.names[id(value)]))
                return value

        return Reads(parameters)


def _to_fake_cpu(model: Any) -> None:
    """Under a ``FakeTensorMode``: every parameter and buffer of ``model`` replaced by a fake CPU tensor of
    its shape and dtype (tied parameters stay one), so that CPU autocast applies to the forward as on a
    rank, without memory."""
    import torch

    made: dict[int, Any] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    fake = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    is_param = isinstance(t, torch.nn.Parameter)
                    made[id(t)] = torch.nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake
                table[name] = made[id(t)]


def _forward_backward(model: Any, inputs: Callable[[int], tuple[Any, ...]], spec: str) -> None:
    """The user's forward and backward on the meta device; what they raise is one line naming the module."""
    import torch

    try:
        device = next(model.parameters()).device  # meta, or fake CPU under autocast
        loss = model(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs(0)))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise CommgateError(f"{spec}: model(*inputs) must return the loss")
        loss.backward()  # type: ignore[no-untyped-call]
    except CommgateError:
        raise
    except Exception as exc:  # the user's forward or backward, run on the meta device
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CommgateError(
            f"{spec}: its forward and backward on the meta device (no weights) raised {type(exc).__name__}: {message}"
        ) from None


def _hooks(
    events: list[tuple[Any, ...]], modules: dict[str, Module], by_name: dict[str, ParamTensor], index: dict[str, int]
) -> tuple[tuple[Hook, ...], tuple[Hook, ...]]:
    """The first pass's hooks (a module takes on a parameter it reads from its first read on) and the
    later passes' (it has them throughout)."""

    def extended(name: str, extra: set[str]) -> Module:
        own = {p.name for p in modules[name].params}
        names = sorted(own | extra, key=index.__getitem__)  # the coordinator's trace sorts by ds_id
        return Module(name, tuple(by_name[n] for n in names))

    external: dict[str, set[str]] = {}
    for e in events:
        if e[0] == "read" and e[2] not in {p.name for p in modules[e[1]].params}:
            external.setdefault(e[1], set()).add(e[2])
    final = {name: extended(name, external.get(name, set())) for name in modules}

    def build(first: bool) -> tuple[Hook, ...]:
        seen: dict[str, set[str]] = {}
        out: list[Hook] = []
        for e in events:
            kind, name = e[0], e[1]
            if kind == "read":
                if e[2] in external.get(name, set()):
                    out.append(Hook(Module(name, (by_name[e[2]],)), True, False, trace=False))
                    seen.setdefault(name, set()).add(e[2])
                continue
            mod = extended(name, seen.get(name, set())) if first else final[name]
            if kind == "leftover":
                out.append(Hook(mod, False, True, leftover=True))
            else:
                out.append(Hook(mod, kind == "fetch", e[2], recompute=e[3]))
        return tuple(out)

    return build(True), build(False)


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flat(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flat(v)]
    return [value]


def _replace(value: Any, swap: dict[int, Any]) -> Any:
    """``value`` with the tensors ``swap`` names swapped, its containers rebuilt: a mapping keeps its own type
    (a copy with the items replaced), since a module may read its output by attribute (Hugging Face's
    ``ModelOutput``, an ``OrderedDict`` with fields: ``outputs.last_hidden_state``)."""
    if isinstance(value, tuple):
        return tuple(_replace(v, swap) for v in value)
    if isinstance(value, list):
        return [_replace(v, swap) for v in value]
    if type(value) is dict:
        return {k: _replace(v, swap) for k, v in value.items()}
    if isinstance(value, dict):
        out = copy.copy(value)
        for k in list(out):
            out[k] = _replace(out[k], swap)
        return out
    return swap.get(id(value), value)
