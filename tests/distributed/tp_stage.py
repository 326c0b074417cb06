"""What the one-stage torchrun scripts of test_tensor_parallel_torchrun.py share
(comm_counts.py, dropout_masks.py, saved_bytes_tp.py): a pp 1 x tp t package's stage 0 on
the model file's model, its runtime, and the split over the ranks' ("tp",) mesh."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh


@dataclass
class OneStage:
    rank: int
    module: ModuleType  # the package's stage0.py (a script may wrap its helpers)
    runtime: ModuleType  # the package's runtime.tensor_parallel
    degree: int  # t
    splits: dict[str, Any]  # stage 0's parameters split over the t ranks
    source: Any  # the model file's ModelSource
    stage: nn.Module  # stage 0 on the model's parameters, whole until split()

    def split(self) -> None:
        """Stage 0 split over the ranks, as train_torchrun splits it."""
        mesh = init_device_mesh("cpu", (self.degree,), mesh_dim_names=("tp",))
        self.runtime.split_stage(self.stage, self.splits, mesh, last=True)

    def step(self) -> Any:
        """The context a split stage's forward runs in."""
        return self.runtime.tensor_step(self.degree, torch.device("cpu"))


def one_stage(package: str, model_file: str, name: str) -> OneStage:
    """The process group started and ``package`` loaded as ``name``: its stage 0 built on
    ``model_file``'s model, not yet split."""
    from fxpipe.codegen import load_package
    from fxpipe.frontend import load_model_file

    dist.init_process_group("gloo")
    load_package(Path(package), name)
    module = importlib.import_module(f"{name}.stage0")
    degree, splits = importlib.import_module(f"{name}.distributed").TENSOR_PARALLEL
    source = load_model_file(model_file)
    return OneStage(dist.get_rank(), module,
                    importlib.import_module(f"{name}.runtime.tensor_parallel"), degree,
                    splits[0], source, module.Stage0(source.model))
