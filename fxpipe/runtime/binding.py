"""How a generated stage holds the model's own parameters, buffers and modules.

A stage binds each object it needs from the model under the same qualified name
(``blocks.0.attn.qkv.weight``), so a stage's ``state_dict`` keys are the model's
and a checkpoint loads unchanged; a tied parameter is the same object in every
stage that binds it.

The modules on the way to a bound object (``blocks`` and ``blocks.0`` above) are
``Container``s holding only what the stage binds. A container reads a child by index
as well as by attribute, ``blocks[0]`` for child "0", so the generated code says
``self.blocks[0].attn.qkv`` as the model's own code does, whether the model's
``blocks`` is a ModuleList, a Sequential or a ModuleDict (``layers["key"]``).
"""

import torch
from torch import nn

__all__ = ["Container", "bind"]


class Container(nn.Module):
    """A stage's stand-in for one of the model's modules: the children the stage binds,
    under their own names, read by attribute or by index (``self.blocks[0]`` is child
    "0", as in the model's ModuleList; ``self.layers["key"]`` is child "key")."""

    def __getitem__(self, key: int | str) -> nn.Module | torch.Tensor:
        """Child ``str(key)``: a module, or a parameter or buffer (a ParameterList's)."""
        name = str(key)
        for table in (self._modules, self._parameters, self._buffers):
            child = table.get(name)
            if child is not None:
                return child
        raise KeyError(f"{name!r} is not bound in this stage; it holds "
                       f"{sorted([*self._modules, *self._parameters, *self._buffers])}")


def bind(stage: nn.Module, model: nn.Module, path: str) -> None:
    """Put the model's own object at ``path`` into ``stage`` under the same name."""
    *parents, leaf = path.split(".")
    source, target = model, stage
    for name in parents:
        source = source.get_submodule(name)
        if name not in target._modules:
            target.add_module(name, Container())
        target = target.get_submodule(name)
    if leaf in source._parameters:
        target.register_parameter(leaf, source._parameters[leaf])
    elif leaf in source._buffers:
        persistent = leaf not in source._non_persistent_buffers_set
        target.register_buffer(leaf, source._buffers[leaf], persistent=persistent)
    else:
        target.add_module(leaf, source.get_submodule(leaf))
