"""Stage checkpoints and model checkpoints are the same keys.

Every generated stage binds the model's own parameters and buffers under their
original qualified names, so a stage's ``state_dict()`` is a slice of the
model's and the stages' states merge back into one model checkpoint. A tied
parameter appears under each of its names (``tok_emb.weight`` in stage 0,
``lm_head.weight`` in the last stage); copies must agree.
"""

import re
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from pickle import UnpicklingError

import torch
from torch import nn

__all__ = ["check_stage_states", "merge_stage_state_dicts", "read_stage_state",
           "split_state_dict"]

_SAVE_STAGES = "save each stage with torch.save(stage.state_dict(), path)"


def read_stage_state(path: Path) -> dict[str, torch.Tensor]:
    """The state_dict ``torch.save`` wrote to ``path``; else ``ValueError`` says what the
    file holds instead (torch's warnings about a file it then refuses are not shown)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            held = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch.load's errors have no common type
            found = re.search(r"GLOBAL (\S+)", str(exc))  # the weights-only unpickler's
            if isinstance(exc, UnpicklingError) and (found or _is_pickle(path)):
                what = (f"pickled Python objects ({found[1]})" if found
                        else "a pickle torch.save did not write")
                raise ValueError(f"{path}: not a stage's state_dict: it holds {what}, which "
                                 f"torch.load(weights_only=True) does not load; "
                                 f"{_SAVE_STAGES}") from None
            raise ValueError(f"{path}: not a file torch.save wrote ({type(exc).__name__}); "
                             f"{_SAVE_STAGES}") from None
    for warning in caught:  # it loaded: what torch warned about stands
        warnings.warn_explicit(warning.message, warning.category, warning.filename,
                               warning.lineno)
    wrong = _not_a_state_dict(held)
    if wrong:
        raise ValueError(f"{path}: not a stage's state_dict (a module's state_dict()): it "
                         f"holds {wrong}; {_SAVE_STAGES}")
    return dict(held)


def _is_pickle(path: Path) -> bool:
    """``path`` starts as a pickle does (its PROTO opcode): torch.save's zip files do not,
    nor does a text file."""
    try:
        with open(path, "rb") as file:
            return file.read(1) == b"\x80"
    except OSError:
        return False


def _not_a_state_dict(held: object) -> str:
    """What ``held`` is, in words, where it is not a state_dict (names -> tensors); ''."""
    if not isinstance(held, Mapping):
        return _a(type(held).__name__)
    if {"state", "param_groups"} <= held.keys():
        return "an optimizer's state_dict ('state', 'param_groups')"
    for key, value in held.items():
        if not isinstance(key, str):
            return f"a dict with the key {key!r} ({_a(type(key).__name__)}, not a name)"
        if isinstance(value, Mapping) and not _not_a_state_dict(value):
            return f"a dict whose {key!r} is a state_dict (save that alone)"
        if not isinstance(value, torch.Tensor):
            return f"a dict whose {key!r} is {_a(type(value).__name__)}, not a tensor"
    return ""


def _a(noun: str) -> str:
    """``noun`` with its indefinite article: "a list", "an int"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def merge_stage_state_dicts(
    states: Sequence[Mapping[str, torch.Tensor]], tied: Iterable[Sequence[str]] = (),
) -> dict[str, torch.Tensor]:
    """One model checkpoint from the stages' ``state_dict()``s, in stage order.

    A key held by several stages (a tied parameter's copies, a shared buffer) must
    have the same dtype, shape and values in each, and so must the keys of one group of
    ``tied`` (a parameter tied under several names, ``Plan.state_keys``); otherwise
    ``ValueError`` names the two copies and what differs."""
    group_of = {key: tuple(group) for group in tied for key in group}
    merged: dict[str, torch.Tensor] = {}
    first: dict[tuple[str, ...], tuple[str, int, torch.Tensor]] = {}  # group -> first copy
    for k, state in enumerate(states):
        for key, value in state.items():
            merged.setdefault(key, value)
            group = group_of.get(key, (key,))
            if group not in first:
                first[group] = (key, k, value)
                continue
            seen_key, seen_k, seen = first[group]
            differs = _difference(seen, value)
            if not differs:
                continue
            if key in group_of:
                copies = (f"{key!r} differs between stage {seen_k} and stage {k}"
                          if key == seen_key else
                          f"{seen_key!r} in stage {seen_k} and {key!r} in stage {k} differ")
                raise ValueError(
                    f"the tied parameter {copies} ({differs}); its copies must be equal: "
                    "synchronize them before saving (copy one stage's into the other's)")
            raise ValueError(
                f"{key!r} differs between stage {seen_k} and stage {k} ({differs}); a key "
                "several stages hold must be the same tensor in each: save the stages of one "
                "model, or synchronize the copies before saving")
    return merged


def _difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """What differs between two copies of one tensor, in words; '' when nothing does."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return "; ".join(
            f"{what} {x} and {y}" for what, x, y in (
                ("dtypes", str(a.dtype).removeprefix("torch."),
                 str(b.dtype).removeprefix("torch.")),
                ("shapes", tuple(a.shape), tuple(b.shape)),
            ) if x != y)
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.is_floating_point() or a.is_complex():
        same = (a == b) | (a.isnan() & b.isnan())  # a NaN where the other has one agrees
        if bool(same.all()):
            return ""
        wide = torch.complex128 if a.is_complex() else torch.float64
        a, b = a.to(wide), b.to(wide)
        gap = (a - b).abs().masked_fill(same, 0).max()
    else:
        if torch.equal(a, b):
            return ""
        gap = (a.double() - b.double()).abs().max()
    return f"largest difference {gap.item():.3g}"


def check_stage_states(
    states: Sequence[Mapping[str, torch.Tensor]], parameters: Sequence[Sequence[str]],
    names: Sequence[str], keys: Iterable[str] = (),
) -> None:
    """``states`` (read from the files ``names``) are every stage of a plan whose stage k
    holds the parameters ``parameters[k]``, in stage order, and hold no key outside
    ``keys`` (every key the plan's stages hold; empty: not checked): a missing, extra or
    misplaced stage would merge into a checkpoint that lacks weights, and a key no stage
    holds into one a strict ``load_state_dict`` refuses, so ``ValueError`` names it.

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
    known = set(keys)
    for state, name in zip(states, names, strict=True) if known else ():
        unknown = [key for key in state if key not in known]
        if unknown:
            raise ValueError(
                f"{name} holds {len(unknown)} key{'s' * (len(unknown) > 1)} that no stage of "
                f"the plan holds (first: {', '.join(map(repr, unknown[:3]))}), which a strict "
                "load_state_dict refuses; save only each stage's state_dict(), or delete them")


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
