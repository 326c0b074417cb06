"""Where stages run: device placement, and copies of tensors bound on other devices.

Tied parameters: a Parameter bound into a stage whose device is not the
Parameter's own (a GPT embedding reused by an LM head on another GPU) is
replaced, for the duration of one ``step``/``forward``, by a fresh copy on that
stage's device; after the step each copy's gradient is added into the original
Parameter's ``.grad``. The optimizer sees only the original Parameter, and
state_dict keys never change. Buffers are treated the same way, without
gradients (in-place buffer updates on a copy are lost). A replica of a stage
that runs on another device than the stage gets the same kind of copies of
every Parameter and buffer of the stage.
"""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = [
    "DeviceSpec",
    "as_device",
    "device_copies",
    "place_stages",
    "replica_devices",
    "stage_devices",
    "to_device",
]

DeviceSpec = torch.device | str | int


def as_device(d: DeviceSpec) -> torch.device:
    """``d`` as a torch.device; an int or a bare "cuda" is a GPU with its index."""
    if isinstance(d, int):
        return torch.device("cuda", d)
    dev = torch.device(d)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def replica_devices(k: int, device: DeviceSpec | Sequence[DeviceSpec],
                    replicas: int) -> list[torch.device]:
    """Stage k's devices, one per replica: ``device`` for all of them, or a sequence
    of ``replicas`` devices."""
    if isinstance(device, torch.device | str | int):
        return [as_device(device)] * replicas
    devices = [as_device(d) for d in device]
    if len(devices) != replicas:
        raise ValueError(
            f"stage {k} has {replicas} replicas but devices[{k}] lists {len(devices)} devices: "
            f"pass one device per replica, or a single device to run them all on"
        )
    return devices


def stage_devices(devices: Sequence[DeviceSpec], device_of: Sequence[int],
                  replicas: Sequence[int], num_gpus: int) -> list[DeviceSpec | list[DeviceSpec]]:
    """One device per stage: ``devices`` as given when there is one per stage;
    when there is one per GPU (``num_gpus``), stage k's is ``devices[device_of[k]]``,
    or the list of its ``replicas[k]`` GPUs from there for a replicated stage."""
    if len(devices) == len(device_of):
        return list(devices)
    if len(devices) == num_gpus:
        return [
            devices[gpu] if count == 1 else list(devices[gpu : gpu + count])
            for gpu, count in zip(device_of, replicas, strict=True)
        ]
    raise ValueError(
        f"got {len(devices)} devices for {len(device_of)} stages on {num_gpus} GPUs; "
        "pass one per stage or one per GPU"
    )


@contextlib.contextmanager
def device_copies(
    stages: Sequence[nn.Module],
    devices: Sequence[torch.device],
    replica_devs: Sequence[Sequence[torch.device]],
    bound: dict[tuple[int, int], dict[str, torch.Tensor]],
) -> Iterator[None]:
    """Bind a copy of every Parameter or buffer that lives on another device than
    its stage, and fill ``bound[(k, i)]`` with copies on the device of every replica
    i of stage k that runs elsewhere than its stage; afterwards add the copies'
    gradients into the originals."""
    copies = _Copies()
    swapped: list[tuple[nn.Module, str, Any, bool]] = []
    for k, stage in enumerate(stages):
        dev = devices[k]
        for i, dev_i in enumerate(replica_devs[k]):
            if dev_i != dev:  # before the swap below: copies of the originals
                params = stage.named_parameters(remove_duplicate=False)
                buffers = stage.named_buffers(remove_duplicate=False)
                bound[(k, i)] = {
                    **{name: copies.on(t, dev_i, True) for name, t in params},
                    **{name: copies.on(t, dev_i, False) for name, t in buffers},
                }
        for module in stage.modules():
            for is_param, table in ((True, module._parameters), (False, module._buffers)):
                for name, t in list(table.items()):
                    if t is None or t.device == dev:
                        continue
                    swapped.append((module, name, t, is_param))
                    table[name] = copies.on(t, dev, is_param)
    try:
        yield
    finally:
        bound.clear()
        # newest first: a module shared by two stages may hold a copy of a copy
        for module, name, original, is_param in reversed(swapped):
            (module._parameters if is_param else module._buffers)[name] = original
        copies.add_grads()


class _Copies:
    """One copy of a tensor per device, shared by every stage that binds it."""

    def __init__(self) -> None:
        self.copies: dict[tuple[int, torch.device], Any] = {}
        self.grads_back: list[tuple[torch.Tensor, nn.Parameter]] = []

    def on(self, t: torch.Tensor, dev: torch.device, is_param: bool) -> Any:
        """``t`` on ``dev``: itself, or its one copy there."""
        if t.device == dev:
            return t
        key = (id(t), dev)
        if key not in self.copies:
            data = t.detach().to(dev, copy=True)
            if is_param:
                replica = nn.Parameter(data, requires_grad=t.requires_grad)
                self.grads_back.append((t, replica))
                self.copies[key] = replica
            else:
                self.copies[key] = data
        return self.copies[key]

    def add_grads(self) -> None:
        """Each Parameter copy's gradient added into its original's ``.grad``."""
        for original, replica in reversed(self.grads_back):
            if replica.grad is None:
                continue
            g = replica.grad.to(original.device)
            if original.grad is None:
                original.grad = g
            else:
                original.grad.add_(g)


def place_stages(stages: Sequence[nn.Module],
                 placed: Sequence[DeviceSpec | Sequence[DeviceSpec]]) -> list[nn.Module]:
    """Each stage moved to its device in ``placed`` (a replicated stage's list: to its
    first replica's device)."""
    return [
        stage.to(device if isinstance(device, torch.device | str | int) else device[0])
        for stage, device in zip(stages, placed, strict=True)
    ]


def to_device(value: Any, dev: torch.device | None) -> Any:
    """``value`` with its tensor leaves copied to ``dev`` (differentiably)."""
    if dev is None:
        return value
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dev), value)
