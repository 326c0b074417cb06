"""``bind``: a stage holds the model's own objects under their original names, and the
modules on the way to them index their children as the model's containers do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxpipe.runtime.binding import Container, bind


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool), persistent=False)


def model() -> nn.Module:
    root = nn.Module()
    root.blocks = nn.ModuleList(Block() for _ in range(3))
    root.heads = nn.ModuleDict({"out-1": nn.Linear(4, 2), "01": nn.Linear(4, 3)})
    root.scales = nn.ParameterList(nn.Parameter(torch.randn(4)) for _ in range(2))
    return root


def test_bound_objects_are_the_models_under_the_same_names() -> None:
    source = model()
    stage = nn.Module()
    for path in ("blocks.2.mlp.0", "blocks.2.mask", "heads.out-1", "scales.1"):
        bind(stage, source, path)
    assert stage.get_submodule("blocks.2.mlp.0") is source.blocks[2].mlp[0]
    assert stage.get_parameter("scales.1") is source.scales[1]
    assert stage.get_buffer("blocks.2.mask") is source.blocks[2].mask
    # the same state_dict keys as the model's (a checkpoint loads unchanged); the mask
    # stays non-persistent, as in the model
    assert sorted(stage.state_dict()) == [
        "blocks.2.mlp.0.bias", "blocks.2.mlp.0.weight", "heads.out-1.bias",
        "heads.out-1.weight", "scales.1",
    ]
    assert set(stage.state_dict()) <= set(source.state_dict())


def test_containers_index_their_children_by_name() -> None:
    source = model()
    stage = nn.Module()
    for path in ("blocks.2.mlp.1", "blocks.0.mask", "heads.01", "heads.out-1", "scales.1"):
        bind(stage, source, path)
    assert isinstance(stage.blocks, Container) and isinstance(stage.blocks[2], Container)
    # only what the stage binds, under the model's indices: blocks[2] is the model's
    # third block even though the stage holds no first or second one's modules
    assert stage.blocks[2].mlp[1] is source.blocks[2].mlp[1]
    assert stage.blocks["2"] is stage.blocks[2]
    assert stage.blocks[0].mask is source.blocks[0].mask
    assert stage.heads["out-1"] is source.heads["out-1"]
    assert stage.heads["01"] is source.heads["01"]
    assert stage.scales[1] is source.scales[1]
    with pytest.raises(KeyError, match="'1' is not bound in this stage; it holds"):
        stage.blocks[1]
