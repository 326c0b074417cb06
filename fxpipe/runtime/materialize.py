"""A rank's stage built without the whole model: parameters on ``meta``, then only
this stage's tensors allocated on its device and filled from a checkpoint.

Build the model with ``parameters_on_meta()``: parameters land on ``meta`` and
buffers stay real (non-persistent buffers such as causal masks are not in
checkpoints). ``materialize`` then gives every parameter and buffer of one stage
an empty tensor on the device and copies its value from the checkpoint by its
original key name (a checkpoint file is memory-mapped), so no rank holds the
whole model.
"""

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import cast

import torch
from torch import nn

__all__ = ["Checkpoint", "load_state", "materialize", "parameters_on_meta", "rebind"]

# What a stage's weights are loaded from: a state_dict, a ``torch.save`` file of one, or
# None (the weights the model was built with).
Checkpoint = str | Path | Mapping[str, torch.Tensor] | None


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build a model with every parameter on ``meta`` (nothing allocated) and its
    buffers real. A parameter assigned twice (a tied weight) stays one object."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]



def load_state(checkpoint: Checkpoint) -> Mapping[str, torch.Tensor] | None:
    if checkpoint is None or isinstance(checkpoint, Mapping):
        return checkpoint
    return torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)


def rebind(module: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Every place ``module`` holds the parameter ``old`` holds ``new`` instead."""
    for submodule in module.modules():
        for key, param in submodule._parameters.items():
            if param is old:
                submodule._parameters[key] = new


def materialize(
    stage: nn.Module,
    device: torch.device,
    state: Mapping[str, torch.Tensor] | None,
    k: int,
) -> None:
    """Give every parameter and buffer of ``stage`` a tensor on ``device``: from
    ``state`` by its original name where it has one, else its own value; one new
    tensor per original object, so ties inside the stage stay ties."""
    owners: dict[int, list[tuple[nn.Module, str, str, bool]]] = {}
    originals: dict[int, torch.Tensor] = {}
    for prefix, module in stage.named_modules(remove_duplicate=False):
        for is_param, table in ((True, module._parameters), (False, module._buffers)):
            for key, tensor in table.items():
                if tensor is None:
                    continue
                name = f"{prefix}.{key}" if prefix else key
                owners.setdefault(id(tensor), []).append((module, key, name, is_param))
                originals[id(tensor)] = tensor
    missing: list[str] = []
    sources: dict[int, torch.Tensor] = {}
    for ident, places in owners.items():
        names = [name for _, _, name, _ in places]
        found = next((n for n in names if state is not None and n in state), None)
        if found is not None:
            source = state[found]  # type: ignore[index]
            if tuple(source.shape) != tuple(originals[ident].shape):
                raise ValueError(
                    f"checkpoint key {found!r} has shape {tuple(source.shape)}, stage {k} "
                    f"needs {tuple(originals[ident].shape)}"
                )
            sources[ident] = source
        elif originals[ident].is_meta:
            missing.append(names[0])
        else:
            sources[ident] = originals[ident]
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} keys stage {k} needs: {', '.join(missing)}"
        )
    if state is None and any(t.device != device for t in originals.values()):
        warnings.warn(
            f"stage {k}: no checkpoint given; using the model's own values", stacklevel=3
        )
    for ident, places in owners.items():
        old = originals[ident]
        with torch.no_grad():
            new = torch.empty(old.shape, dtype=old.dtype, device=device)
            new.copy_(sources[ident])
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        for module, key, _, is_param in places:
            if is_param:
                module._parameters[key] = cast(nn.Parameter, new)
            else:
                module._buffers[key] = new

