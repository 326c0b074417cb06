"""Weight stashing (PipeDream's asynchronous 1F1B; Harlap, Narayanan et al., SOSP 2019).

``step(..., optimizers=opts)`` with one optimizer per stage updates stage k's
weights right after every backward B(k, m) (``opts[k].step()``, then
``opts[k].zero_grad()``). The forward F(k, m) uses the weights current at that
moment, and B(k, m) uses that same version, stashed at F(k, m), not the newer
live ones. Version v of a stage is its weights after v updates; 1F1B with
K = 2, M = 4::

    stage 0 | F0 F1 .. B0 F2 B1 F3 B2 .. B3     F(0, m) uses version max(0, m - 1)
    uses    | v0 v0 .. v0 v1 v0 v2 v1 .. v2     B(0, m) the version F(0, m) used
    makes   |          v1    v2    v3    v4     opts[0].step() after each B
    stage 1 | .. F0 B0 F1 B1 F2 B2 F3 B3 ..     F(1, m) and B(1, m) use version m

Each micro-batch is its own update: its loss is not divided by M, and ``step``
returns the mean loss over the micro-batches. The gradient of B(k, m) replaces
(not adds to) ``.grad`` of stage k's Parameters before ``opts[k].step()``. A
Parameter may belong to one stage only. Memory: F(k, m) copies stage k's
Parameters that require grad (micro-batches starting on the same version share
one copy), and a copy is freed after the last B that uses it, so stage k holds
at most one parameter copy per micro-batch in flight (exactly that many in
1F1B's steady state, where every in-flight micro-batch has its own version).
Recompute re-runs the forward with the stashed copy.
"""

import warnings
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["Stash", "WeightStashes", "check_optimizers", "check_stashing", "check_unshared"]

Stash = dict[str, torch.Tensor]  # parameter name -> its copy at F(k, m)
Optimizers = Sequence[torch.optim.Optimizer | None]


class WeightStashes:
    """One step's stashed weights: per stage its optimizer, its live Parameters by
    name (taken before any device copies are bound), its number of updates so far
    (its weights' version) and the newest stash with its version."""

    def __init__(self, stages: Sequence[nn.Module], optimizers: Optimizers) -> None:
        self.optimizers = list(optimizers)
        self.params = [dict(stage.named_parameters(remove_duplicate=False)) for stage in stages]
        self.updates = [0] * len(stages)
        self.newest: dict[int, tuple[int, Stash]] = {}

    def stash(self, k: int, dev: torch.device | None) -> Stash:
        """Stage k's Parameters that require grad, as detached copies of their current
        version on ``dev`` (shared by the micro-batches that start on this version).
        Call it on stage k's stream."""
        version = self.updates[k]
        cached = self.newest.get(k)
        if cached is not None and cached[0] == version:
            return cached[1]
        copies: dict[int, torch.Tensor] = {}  # id(Parameter) -> its copy, one for all its names
        for p in self.params[k].values():
            if p.requires_grad and id(p) not in copies:
                copies[id(p)] = p.detach().to(dev or p.device, copy=True).requires_grad_()
        stash = {name: copies[id(p)] for name, p in self.params[k].items() if id(p) in copies}
        self.newest[k] = (version, stash)
        return stash

    def update(self, k: int, stash: Stash) -> None:
        """After B(k, m): the stash's gradients become the live Parameters' ``.grad``
        (replacing it), stage k's optimizer steps and zeroes them."""
        moved: set[int] = set()
        for name, copy in stash.items():
            if id(copy) in moved:
                continue  # another name of the same Parameter
            moved.add(id(copy))
            param = self.params[k][name]
            g, copy.grad = copy.grad, None  # the stash may serve a later micro-batch too
            param.grad = None if g is None else g.to(param.device)
        optimizer = self.optimizers[k]
        if optimizer is not None:  # None: the stage has nothing to train
            optimizer.step()
            optimizer.zero_grad()
        self.updates[k] += 1
        self.newest.pop(k, None)  # the next F(k, .) copies the new version


def check_stashing(stages: Sequence[nn.Module], weight_stashing: bool, *, scaled: bool) -> None:
    """What weight stashing needs: no GradScaler (``scaled``: 16-mixed), since every update
    happens inside step, and no Parameter in two stages (``check_unshared``)."""
    if not weight_stashing:
        return
    if scaled:
        raise ValueError(
            "weight stashing updates every stage inside step, where a GradScaler cannot "
            "step: train 16-mixed with --schedule 1f1b or gpipe, or use bf16-mixed"
        )
    check_unshared(stages)


def check_unshared(stages: Sequence[nn.Module]) -> None:
    """With weight stashing each stage updates its own weights: no Parameter may be
    bound into two stages."""
    owner: dict[int, tuple[int, str]] = {}
    for k, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            first = owner.setdefault(id(param), (k, name))
            if first[0] != k:
                raise ValueError(
                    f"parameter {first[1]!r} of stage {first[0]} is also bound into stage {k} "
                    f"(as {name!r}): with weight_stashing each stage updates its own weights "
                    f"after every micro-batch, so a parameter can belong to one stage only; "
                    f"untie it or keep its uses on one stage"
                )


def check_optimizers(stages: Sequence[nn.Module], weight_stashing: bool,
                     optimizers: Optimizers | None) -> None:
    """``step``'s ``optimizers``: one per stage over its own parameters with weight
    stashing, none (a warning otherwise) without it."""
    num_stages = len(stages)
    if not weight_stashing:
        if optimizers is not None:
            warnings.warn(
                "step() got optimizers, but this runner was built with "
                "weight_stashing=False, so they are ignored: call optimizer.step() "
                "after step(), or build the runner with weight_stashing=True.",
                stacklevel=3,
            )
        return
    if optimizers is None:
        raise ValueError(
            f"with weight_stashing=True every stage updates its weights after each "
            f"micro-batch: pass step(..., optimizers=[...]) with one optimizer per stage "
            f"({num_stages}), each over that stage's parameters"
        )
    if len(optimizers) != num_stages:
        raise ValueError(
            f"got {len(optimizers)} optimizers for {num_stages} stages: with "
            f"weight_stashing pass one optimizer per stage, over that stage's parameters"
        )
    for k, opt in enumerate(optimizers):
        trainable = [name for name, p in stages[k].named_parameters() if p.requires_grad]
        if opt is None and trainable:
            raise ValueError(
                f"optimizers[{k}] is None, but stage {k} has trainable parameters "
                f"({trainable[0]!r}, ...): pass an optimizer over stages[{k}].parameters()"
            )
        if opt is None:
            continue
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(
                f"optimizers[{k}] is a {type(opt).__name__}, not a torch.optim.Optimizer"
            )
        own = {id(param) for param in stages[k].parameters()}
        for group in opt.param_groups:
            for param in group["params"]:
                if id(param) not in own:
                    raise ValueError(
                        f"optimizers[{k}] updates {_param_name(stages, param)}, which is not "
                        f"a parameter of stage {k}: give each stage an optimizer over "
                        f"its own parameters (stages[{k}].parameters())"
                    )


def _param_name(stages: Sequence[nn.Module], param: torch.Tensor) -> str:
    for k, stage in enumerate(stages):
        for name, p in stage.named_parameters(remove_duplicate=False):
            if p is param:
                return f"parameter {name!r} of stage {k}"
    return f"a parameter of shape {tuple(param.shape)} in no stage"
