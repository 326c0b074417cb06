"""Stage checkpoints and model checkpoints are the same keys.

Every generated stage binds the model's own parameters and buffers under their
original qualified names, so a stage's ``state_dict()`` is a slice of the
model's and the stages' states merge back into one model checkpoint. A tied
parameter appears under each of its names (``tok_emb.weight`` in stage 0,
``lm_head.weight`` in the last stage); copies must agree.
"""

from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = ["check_stage_states", "merge_stage_state_dicts", "split_state_dict"]


def merge_stage_state_dicts(
    states: Sequence[Mapping[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """One model checkpoint from the stages' ``state_dict()``s, in stage order.

    A key held by several stages (a tied or replicated parameter, a shared
    buffer) must have identical values in each; otherwise ``ValueError`` names it.
    """
    merged: dict[str, torch.Tensor] = {}
    first: dict[str, int] = {}
    for k, state in enumerate(states):
        for key, value in state.items():
            if key not in merged:
                merged[key] = value
                first[key] = k
                continue
            seen = merged[key]
            same = (
                seen.shape == value.shape
                and seen.dtype == value.dtype
                and torch.equal(seen.detach().cpu(), value.detach().cpu())
            )
            if not same:
                raise ValueError(
                    f"{key!r} differs between stage {first[key]} and stage {k} "
                    f"(shapes {tuple(seen.shape)} and {tuple(value.shape)}); a tied parameter "
                    "must hold the same values in every stage: synchronize the copies "
                    "before saving"
                )
    return merged


def check_stage_states(
    states: Sequence[Mapping[str, torch.Tensor]], parameters: Sequence[Sequence[str]],
    names: Sequence[str],
) -> None:
    """``states`` (read from the files ``names``) are every stage of a plan whose stage k
    holds the parameters ``parameters[k]``, in stage order: a missing, extra or misplaced
    stage would merge into a checkpoint that lacks weights, so ``ValueError`` names it.

    A parameter tied across stages is listed under one name in each of them while a stage
    may hold it under another (``lm_head.weight`` for ``tok_emb.weight``), so only the
    parameters that one stage alone holds identify its file."""
    if len(states) != len(parameters):
        raise ValueError(
            f"the plan has {len(parameters)} stages, got {len(states)} checkpoints; pass "
            f"one file per stage, in stage order"
        )
    holders = Counter(key for expected in parameters for key in set(expected))
    for k, (state, expected, name) in enumerate(zip(states, parameters, names, strict=True)):
        missing = [key for key in expected if holders[key] == 1 and key not in state]
        if missing:
            raise ValueError(
                f"{name} lacks {len(missing)} parameters of stage {k} (first: "
                f"{missing[0]!r}); pass one file per stage, in stage order"
            )


def split_state_dict(
    model_state: Mapping[str, torch.Tensor], stages: Sequence[nn.Module]
) -> list[dict[str, torch.Tensor]]:
    """The slice of ``model_state`` each stage holds, ready for ``stage.load_state_dict``."""
    slices = []
    for k, stage in enumerate(stages):
        keys = list(stage.state_dict().keys())
        missing = [key for key in keys if key not in model_state]
        if missing:
            raise ValueError(
                f"stage {k} holds {len(missing)} keys the checkpoint lacks (first: "
                f"{missing[:3]}); load a checkpoint of the model these stages were built from"
            )
        slices.append({key: model_state[key] for key in keys})
    return slices
