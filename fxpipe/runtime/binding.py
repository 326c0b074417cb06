"""How a generated stage holds the model's own parameters, buffers and modules.

A stage binds each object it needs from the model under the same qualified name
(``blocks.0.attn.qkv.weight``), so a stage's ``state_dict`` keys are the model's
and a checkpoint loads unchanged; a tied parameter is the same object in every
stage that binds it.
"""

from torch import nn

__all__ = ["bind"]


def bind(stage: nn.Module, model: nn.Module, path: str) -> None:
    """Put the model's own object at ``path`` into ``stage`` under the same name."""
    *parents, leaf = path.split(".")
    source, target = model, stage
    for name in parents:
        source = source.get_submodule(name)
        if name not in target._modules:
            target.add_module(name, nn.Module())
        target = target.get_submodule(name)
    if leaf in source._parameters:
        target.register_parameter(leaf, source._parameters[leaf])
    elif leaf in source._buffers:
        persistent = leaf not in source._non_persistent_buffers_set
        target.register_buffer(leaf, source._buffers[leaf], persistent=persistent)
    else:
        target.add_module(leaf, source.get_submodule(leaf))
