"""The model's own activation checkpointing, traced as plain calls.

A model may checkpoint its activations itself (``torch.utils.checkpoint``, transformers'
``activation_checkpointing_enable``, reentrant by default in transformers 4 as
``gradient_checkpointing_enable``). Traced as it runs, a reentrant checkpoint is a
Function whose forward runs under ``torch.no_grad()``: export records that region, and
the graph's checkpointed layers get no gradient (transformers' Llama: its output needed
none, and the first backward failed); symbolic_trace cannot record it. A non-reentrant
one hooks the saved tensors.
Neither is what the stages should run: recompute is fxpipe's choice, a whole stage at a
time, where ``--recompute`` says (``auto``: where memory needs it), as the plan counts
it. So while a model is traced, ``checkpoint`` calls the checkpointed function as is
(``plain_calls``), and the note says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.utils.checkpoint as checkpoint

__all__ = ["describe", "plain_calls"]


@contextlib.contextmanager
def plain_calls() -> Iterator[list[tuple[Any, Any]]]:
    """While open, ``torch.utils.checkpoint.checkpoint`` (reentrant or not) calls the
    function it is given as is, and appends it, once, to the list it yields (a trace may
    run forward more than once: symbolic_trace, then export)."""
    seen: list[tuple[Any, Any]] = []
    generator = checkpoint._checkpoint_without_reentrant_generator
    reentrant = checkpoint.CheckpointFunction

    def note(function: Any) -> None:
        # a bound method is made anew at each access: known by its object and function
        key = (getattr(function, "__self__", None), getattr(function, "__func__", function))
        if not any(key[0] is k[0] and key[1] is k[1] for k in seen):
            seen.append(key)

    def nothing_around(function: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        # checkpoint() calls the function between this generator's two steps
        note(function)
        yield

    class Plain(reentrant):  # type: ignore[misc,valid-type]
        @classmethod
        def apply(cls, function: Any, preserve_rng_state: Any, *args: Any) -> Any:
            note(function)
            return function(*args)

    checkpoint._checkpoint_without_reentrant_generator = nothing_around  # type: ignore[assignment]
    checkpoint.CheckpointFunction = Plain  # type: ignore[misc]
    try:
        yield seen
    finally:
        checkpoint._checkpoint_without_reentrant_generator = generator
        checkpoint.CheckpointFunction = reentrant  # type: ignore[misc]


def describe(regions: int) -> str:
    """The note for a model that checkpoints ``regions`` callables itself."""
    return (f"the model checkpoints its own activations (torch.utils.checkpoint of "
            f"{regions} callables): traced as plain calls, whose activations the stages "
            f"keep; fxpipe recomputes whole stages instead, where --recompute says (auto: "
            f"where memory needs it), and the plan counts that")
