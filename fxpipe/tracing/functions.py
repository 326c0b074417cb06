"""The model's own ``torch.autograd.Function``s, as a trace meets them.

Left to themselves, both tracers run a Function's ``forward`` and record the ops inside,
so the stages would differentiate those ops with autograd and never run its
``backward``. Where the backward is the forward's derivative written by hand (a fused or
memory-saving activation, Bloom's GeLU) that changes only rounding; where it is not (a
gradient reversal layer, a straight-through estimator) the pipeline's gradients would
not be the model's. So each call of one is kept as one node, whose target, an
``Applied``, calls the Function's ``apply``: the stages run its forward and its backward
as the model does, and the generated code calls ``TheFunction.apply(...)``.

- ``symbolic_trace``: ``kept_functions`` records the call in place of running it.
- ``torch.export``: ``exported_functions`` has export record it as a ``flat_apply``
  node (torch's experimental ``allow_in_pre_dispatch_graph``), which ``applied_calls``
  turns into the same call. Where export cannot hold that node (inside an autocast
  region), the model is exported again running through the Function.

A call is kept where the Function is defined at the top level of its module, as a stage
finds it by name there, and every argument is one a graph holds (not an object of the
model's). Any other is run through, and the frontend says so in a note naming each such
Function and where it is defined (``applied_functions``, ``describe``); or refuses the
model (``refusal``) where that Function's forward sets the grad mode (a memory-saving one
that runs its layers under ``no_grad`` and again in its backward, as Reformer's reversible
layers do): torch runs a Function's forward without grad, and export records the mode
its forward leaves for the rest of the model. torch's
own Functions (reentrant checkpoint's, for one) are left to the tracers: their backward
is the derivative of what they run.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["Applied", "Calls", "applied_calls", "applied_functions", "describe",
           "exported_functions", "kept", "kept_functions", "refusal"]

Apply = Callable[..., Any]  # apply(cls, *args, **kwargs), as Function.apply is called


@contextlib.contextmanager
def _apply_replaced(make: Callable[[Apply], Apply]) -> Iterator[None]:
    """While open, ``Function.apply`` is ``make(before)``, where ``before(cls, *args,
    **kwargs)`` runs the ``apply`` in place when it opened (torch's, or an enclosing
    one of these: they nest)."""
    installed = torch.autograd.Function.__dict__["apply"]  # a classmethod

    def before(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        return installed.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(make(before))  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.autograd.Function.apply = installed  # type: ignore[method-assign]


def _own(cls: type[torch.autograd.Function]) -> bool:
    """A Function of the model's, not one of torch's."""
    return not cls.__module__.startswith("torch.")


def _named(cls: type[torch.autograd.Function]) -> bool:
    """Defined at the top level of its module, where a generated stage can find it."""
    return "." not in cls.__qualname__ and "<" not in cls.__qualname__


def _graphable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Every argument something a graph node can hold (a tensor, a traced value, a number,
    a string...), not an object of the model's, which the call is run through with."""
    kinds = (torch.fx.Proxy, type(None), *torch.fx.node.base_types)
    return all(isinstance(v, kinds) for v in pytree.tree_leaves((args, kwargs)))


@dataclass
class Calls:
    """The model's own Functions whose ``apply`` ran while ``applied_functions`` was open,
    each once: ``functions`` all of them, ``grad_mode`` those whose forward set the grad
    mode as it ran (``torch.no_grad()``, ``enable_grad()``, ``set_grad_enabled()``)."""

    functions: list[type[torch.autograd.Function]] = field(default_factory=list)
    grad_mode: set[type[torch.autograd.Function]] = field(default_factory=set)


class _GradModeSet(TorchFunctionMode):
    """Whether a call under it set the grad mode: each of torch's ways to set it
    (``no_grad``, ``enable_grad``, ``set_grad_enabled``) goes through
    ``torch._C._set_grad_enabled``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch._C._set_grad_enabled:
            self.seen = True
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def applied_functions() -> Iterator[Calls]:
    """While open, what the model's own ``torch.autograd.Function``s do when their
    ``apply`` runs (``Calls``)."""
    calls = Calls()

    def noting(before: Apply) -> Apply:
        def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
            if not _own(cls):
                return before(cls, *args, **kwargs)
            if cls not in calls.functions:
                calls.functions.append(cls)
            with _GradModeSet() as mode:
                out = before(cls, *args, **kwargs)
            if mode.seen:
                calls.grad_mode.add(cls)
            return out
        return apply

    with _apply_replaced(noting):
        yield calls


class Applied:
    """The target of a graph node that calls ``function.apply``: one per Function class,
    named (for fx's printed code and the stage's) after it."""

    def __init__(self, function: type[torch.autograd.Function]) -> None:
        self.function = function
        self.__name__ = f"{function.__name__}_apply"
        self.__qualname__ = f"{function.__qualname__}.apply"
        self.__module__ = function.__module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.__module__}.{self.__qualname__}"


@contextlib.contextmanager
def kept_functions() -> Iterator[None]:
    """While open (around ``symbolic_trace``), a call of a model's own Function on a
    traced value is recorded as one node calling it, not run."""
    targets: dict[type[torch.autograd.Function], Applied] = {}

    def recording(before: Apply) -> Apply:
        def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
            proxies = [v for v in pytree.tree_leaves((args, kwargs))
                       if isinstance(v, torch.fx.Proxy)]
            if not (proxies and _own(cls) and _named(cls) and _graphable(args, kwargs)):
                return before(cls, *args, **kwargs)
            target = targets.setdefault(cls, Applied(cls))
            proxy = proxies[0].tracer.create_proxy("call_function", target, args, kwargs)
            proxy.node.meta["is_wrapped"] = True  # fx prints it as a wrapped function's
            # call, which codegen turns into the Function's (codegen/stages.py)
            return proxy
        return apply

    with _apply_replaced(recording):
        yield


@contextlib.contextmanager
def exported_functions() -> Iterator[list[type[torch.autograd.Function]]]:
    """While open (around ``torch.export``), a call of a model's own top-level Function is
    recorded as one ``flat_apply`` node (torch's experimental
    ``allow_in_pre_dispatch_graph``), which ``applied_calls`` turns into an ``Applied``
    call; yields the list of the Functions it recorded so. A call with an argument a graph
    cannot hold, and any call on a torch without that wrapper, runs through the
    Function."""
    recorded: list[type[torch.autograd.Function]] = []  # the Functions it recorded so
    try:
        from torch._export.wrappers import allow_in_pre_dispatch_graph
    except ImportError:
        yield recorded
        return

    def one_call_each(before: Apply) -> Apply:
        def run(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
            return before(cls, *args, **kwargs)

        run.__name__ = "apply"  # the name the wrapper accepts
        one_call = allow_in_pre_dispatch_graph(run)

        def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
            if _own(cls) and _named(cls) and _graphable(args, kwargs):
                recorded.append(cls)
                return one_call(cls, *args, **kwargs)
            return before(cls, *args, **kwargs)
        return apply

    with _apply_replaced(one_call_each):
        yield recorded


def applied_calls(gm: torch.fx.GraphModule) -> None:
    """Each ``flat_apply`` node ``exported_functions`` left in ``gm`` made a call of an
    ``Applied``, with the Function's own arguments; the constants it read removed."""
    flat_apply = getattr(torch.ops.higher_order, "flat_apply", None)
    targets: dict[str, Applied] = {}
    read: set[str] = set()  # the attributes the rewritten nodes read
    for node in list(gm.graph.nodes):
        if flat_apply is None or node.op != "call_function" or node.target is not flat_apply:
            continue
        func_node, spec_node, *flat = node.args
        assert isinstance(func_node, torch.fx.Node) and isinstance(spec_node, torch.fx.Node)
        (name, *args), kwargs = pytree.tree_unflatten(flat, _attribute(gm, spec_node))
        target = targets.setdefault(name, Applied(_function_named(str(name))))
        assert _attribute(gm, func_node).func.__name__.endswith("autograd_function_in_pre_dispatch")
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(target, tuple(args), kwargs)
        call.meta = {**node.meta, "is_wrapped": True}
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        for attribute in (func_node, spec_node):
            if not attribute.users:
                gm.graph.erase_node(attribute)
                read.add(str(attribute.target))
    still_read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name in sorted(read - still_read):
        delattr(gm, name)
    gm.recompile()


def _function_named(name: str) -> type[torch.autograd.Function]:
    """The Function export names ``module.qualname``: its module's, where that module is in
    ``sys.modules``; else (a model file loaded by path under a name not registered there)
    the latest defined of Function's subclasses of that module and name."""
    module, _, qualname = name.rpartition(".")
    found = getattr(sys.modules.get(module), qualname, None)
    if isinstance(found, type) and issubclass(found, torch.autograd.Function):
        return found
    named = [cls for cls in _subclasses(torch.autograd.Function)
             if cls.__module__ == module and cls.__qualname__ == qualname]
    assert named, name  # export recorded a call of it
    return named[-1]


def _subclasses(cls: type[torch.autograd.Function]) -> Iterator[type[torch.autograd.Function]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _attribute(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Any:
    """The constant a ``get_attr`` node of ``flat_apply`` reads: a TreeSpec, or the
    constant function whose spec it is."""
    value = getattr(gm, str(node.target))
    if isinstance(value, pytree.TreeSpec) and value.num_leaves == 0:
        return pytree.tree_unflatten([], value)
    return value


def kept(gm: torch.fx.GraphModule) -> set[type[torch.autograd.Function]]:
    """The Functions ``gm`` calls as nodes of its own."""
    return {n.target.function for n in gm.graph.nodes if isinstance(n.target, Applied)}


def describe(functions: list[type[torch.autograd.Function]]) -> str:
    """The note for the Functions a trace ran through (see the module docstring)."""
    names = ", ".join(f"{cls.__qualname__} ({_where(cls)})" for cls in functions)
    return (f"the model calls torch.autograd.Function {names}: the stages run the ops of "
            f"its forward and autograd's derivative of them, not its backward; where that "
            f"backward is not the forward's derivative (a gradient reversal, a "
            f"straight-through estimator) the pipeline's gradients are not the model's")


def refusal(functions: list[type[torch.autograd.Function]]) -> str:
    """The error for Functions run through whose forward sets the grad mode: torch.export
    records the forward's ops (which torch runs without grad) as the model's, and the
    mode the forward leaves for every op after the call."""
    names = ", ".join(f"{cls.__qualname__} ({_where(cls)})" for cls in functions)
    return (f"the model's torch.autograd.Function {names} sets the grad mode in its "
            f"forward (as a Function that recomputes in its backward does), and fxpipe, "
            f"which runs its forward's ops rather than calling it, would leave them and "
            f"the rest of the model without gradients; define it at the top level of its "
            f"module and pass it only tensors, numbers and strings (no modules or other "
            f"objects), so that the stages call it as the model does")


def _where(cls: type) -> str:
    try:
        path = inspect.getsourcefile(cls)
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return cls.__module__
    return f"{path}:{line}" if path else cls.__module__
