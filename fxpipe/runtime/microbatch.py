"""Split a mini-batch into micro-batches and replica chunks, and merge them back.

The one owner of batch splitting for the single-process runner, the torchrun
pipeline and its uneven-replica schedule: every split is ``torch.tensor_split``
along dim 0 of the tensor leaves of a pytree, and every merge its inverse.

# m: micro-batches, r: replicas of a stage.

A value's *batched* leaves are the tensors with dim > 0 (micro-batches) or whose
dim 0 equals the batch size being split (replicas); every other leaf (0-dim
tensors, non-tensors, a causal mask of shape (1, 1, T, T)) goes whole to every
part. A graph input that the compiler found to have no batch dimension (a shared
input: a (T, T) causal mask, HF's ``position_ids`` of shape (1, T)) goes whole to
every part too, whatever its shape (``split_inputs``; under torchrun, where torch's
schedules cut the first stage's inputs, ``torch_chunk_spec`` tells them the same).

Every batched leaf of the graph inputs, and of a target, must have the same number of
rows (``batch_rows``, ``check_rows``): micro-batch m of a shorter one would be another
share of its rows, which the stages would broadcast where the model refuses. The merge
of the outputs (``concat``) refuses what concatenation cannot rebuild, and graph inputs
the model writes in place are written back into the caller's tensors (``write_back``).
"""

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "batch_rows",
    "batch_size",
    "check_rows",
    "chunk_sizes",
    "concat",
    "lane_share",
    "merge_leaves",
    "microbatch_count",
    "own_copies",
    "rows_of",
    "sample_share",
    "shared_leaves",
    "split_inputs",
    "split_leaves",
    "split_microbatches",
    "split_replicas",
    "torch_chunk_spec",
    "write_back",
    "written_back",
]


def split_leaves(value: Any, n: int, splits: Callable[[torch.Tensor], bool]) -> list[Any]:
    """``n`` trees shaped like ``value``: the tensor leaves ``splits`` accepts cut along
    dim 0 into n chunks (``torch.tensor_split``), every other leaf whole in each."""
    leaves, spec = pytree.tree_flatten(value)
    columns = [torch.tensor_split(x, n, dim=0) if isinstance(x, torch.Tensor) and splits(x)
               else [x] * n for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in columns], spec) for i in range(n)]


def merge_leaves(trees: list[Any], merge: Callable[[list[Any]], Any]) -> Any:
    """One tree from ``trees`` of one structure: each leaf is ``merge`` of that leaf's
    values in every tree, in order (the inverse of ``split_leaves``)."""
    flat = [pytree.tree_flatten(tree) for tree in trees]
    leaves0, spec = flat[0]
    return pytree.tree_unflatten(
        [merge([leaves[i] for leaves, _ in flat]) for i in range(len(leaves0))], spec)


def microbatch_count(value: Any, num_mb: int) -> int:
    """How many micro-batches ``value`` makes: ``num_mb``, or its number of samples when
    it has fewer (the last batch of an epoch), so that no micro-batch is empty."""
    sizes = [x.size(0) for x in pytree.tree_leaves(value)
             if isinstance(x, torch.Tensor) and x.dim() > 0]
    if sizes and min(sizes) == 0:
        raise ValueError("the mini-batch is empty (a tensor input has 0 rows along dim 0): "
                         "pass at least one sample")
    return min([num_mb, *sizes])


def sample_share(batch: list[int | None], m: int) -> float:
    """Micro-batch m's share of the samples of micro-batches of ``batch`` samples each
    (1/M without a batch dim): the weight of its loss in a per-sample mean."""
    size = batch[m]
    if size is None or None in batch:
        return 1.0 / len(batch)
    return size / sum(b for b in batch if b is not None)


def split_microbatches(value: Any, num_mb: int, what: str | None = None, *,
                       copy: bool = False) -> list[Any]:
    """Split every tensor leaf of ``value`` with dim > 0 along dim 0 into ``num_mb``
    chunks as evenly as ``torch.tensor_split`` does (sizes differ by at most one);
    0-dim tensors and non-tensors go to every micro-batch unchanged. With ``what``
    (for messages), a leaf with fewer than ``num_mb`` rows is an error.

    With ``copy``, every micro-batch gets its own copy of the tensor leaves: chunks of
    one tensor share its version counter, so a model that writes its input in place
    (``x.mul_(2)``) would bump the counter of every micro-batch's chunk and break the
    backward of those already saved."""
    if what is not None:
        for x in pytree.tree_leaves(value):
            if isinstance(x, torch.Tensor) and x.dim() > 0 and x.size(0) < num_mb:
                raise ValueError(
                    f"the {what} has batch size {x.size(0)}, fewer than the {num_mb} "
                    f"micro-batches the inputs make: give it one row per sample"
                )
    parts = split_leaves(value, num_mb, lambda x: x.dim() > 0)
    if copy and num_mb > 1:
        parts = [pytree.tree_map_only(torch.Tensor, torch.clone, part) for part in parts]
    return parts


def split_inputs(flat: dict[str, Any], microbatches: int, shared: Collection[str],
                 written: Collection[str] = ()) -> list[dict[str, Any]]:
    """The graph inputs ``flat`` (name -> value) of each micro-batch: M of them, or one
    per sample when the batched inputs have fewer (``microbatch_count``); every input
    split by ``split_microbatches``, but those named in ``shared`` whole in each (a copy
    each of those a stage writes in place, ``written``: the model writes them once)."""
    unknown = sorted(set(shared) - set(flat))
    if unknown:
        raise ValueError(
            f"shared_inputs names {unknown}, which are not graph inputs (the inputs are "
            f"{sorted(flat)}): name inputs that flatten_inputs returns"
        )
    batch_rows(flat, shared)
    num_mb = microbatch_count([v for name, v in flat.items() if name not in shared],
                              microbatches)

    def whole(name: str, v: Any) -> list[Any]:
        if name not in written:
            return [v] * num_mb
        return [pytree.tree_map_only(torch.Tensor, torch.clone, v) for _ in range(num_mb)]

    per_name = {name: (whole(name, v) if name in shared
                       else split_microbatches(v, num_mb, f"input {name!r}", copy=True))
                for name, v in flat.items()}
    return [{name: parts[m] for name, parts in per_name.items()} for m in range(num_mb)]


def _leaf_paths(value: Any) -> list[str]:
    """Each leaf's path in ``value`` as ``pytree.keystr`` writes it ("" for the value
    itself, "[0]" for a tuple's first, "['x']" for a dict's), for messages."""
    try:
        return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(value)[0]]
    except (NotImplementedError, ValueError):  # a node type registered without keys
        return [f" (leaf {i})" for i in range(len(pytree.tree_leaves(value)))]


def _rows(value: Any) -> list[tuple[str, int]]:
    """(path, rows along dim 0) of each tensor leaf of ``value`` with dim > 0."""
    return [(path, int(x.size(0)))
            for path, x in zip(_leaf_paths(value), pytree.tree_leaves(value), strict=True)
            if isinstance(x, torch.Tensor) and x.dim() > 0]


def _input_rows(flat: Mapping[str, Any], shared: Collection[str]) -> list[tuple[str, int]]:
    """(name, rows) of every batched leaf of the graph inputs ``flat`` (name -> value):
    the tensor leaves with dim > 0 of the inputs not in ``shared``."""
    return [(f"{name}{path}", n) for name, value in flat.items() if name not in shared
            for path, n in _rows(value)]


def batch_rows(flat: Mapping[str, Any], shared: Collection[str] = ()) -> int | None:
    """The rows along dim 0 of the batched graph inputs among ``flat`` (name -> value),
    None without one. They must all have the same rows: a micro-batch pairs share m of
    each, and a shorter one's share would broadcast where the model refuses."""
    rows = _input_rows(flat, shared)
    if len({n for _, n in rows}) > 1:
        listed = ", ".join(f"{name}: {n}" for name, n in rows)
        raise ValueError(
            f"the batched inputs have different numbers of rows along dim 0 ({listed}): "
            f"pass one row per sample in each, all with the same batch size"
        )
    return rows[0][1] if rows else None


def check_rows(value: Any, flat: Mapping[str, Any], shared: Collection[str], what: str) -> None:
    """Every tensor leaf with dim > 0 of ``value`` (the ``what``, for messages: the
    target) has the rows of the batched graph inputs in ``flat`` (``batch_rows``)."""
    inputs = _input_rows(flat, shared)
    rows = _rows(value)
    if inputs and any(n != inputs[0][1] for _, n in rows):
        ours = ", ".join(f"{what}{path}: {n}" for path, n in rows)
        theirs = ", ".join(f"{name}: {n}" for name, n in inputs)
        raise ValueError(
            f"the {what}'s rows along dim 0 ({ours}) differ from the inputs' ({theirs}): "
            f"pass one row of the {what} per sample of the inputs"
        )


def torch_chunk_spec(names: Sequence[str], shapes: Sequence[tuple[int, ...]],
                     shared: Collection[str]) -> tuple[Any, ...]:
    """``split_inputs``' rule for the graph inputs ``names`` (of example ``shapes``) as
    torch.distributed.pipelining's ``args_chunk_spec``: cut along dim 0 (torch's
    schedules cut with ``torch.tensor_split`` too), but a shared input, or a 0-dim
    tensor, handed whole to every micro-batch."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    return tuple(_Replicate() if name in shared or not shape else TensorChunkSpec(0)
                 for name, shape in zip(names, shapes, strict=True))


def shared_leaves(flat: Mapping[str, Any], shared: Collection[str]) -> frozenset[int]:
    """The ids of the tensors among the graph inputs ``flat`` (name -> value, what
    ``flatten_inputs`` returns) that ``shared`` names: for the functions that take the
    model's (args, kwargs), whose leaves are those very tensors."""
    return frozenset(id(x) for name, value in flat.items() if name in shared
                     for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor))


def concat(outputs: list[Any], rows: Sequence[int | None] = ()) -> Any:
    """One output from per-micro-batch outputs (of ``rows`` samples each, where known): the
    inverse of the split where there is one. Tensor leaves are concatenated along dim 0,
    other leaves taken from micro-batch 0. What that would get wrong is refused, naming
    the output: a 0-dim tensor (the mini-batch's mean is the micro-batches' mean only for
    equal micro-batches and a mean, a sum their sum), a tensor whose dim 0 does not count
    the samples, a non-tensor that differs between micro-batches. One micro-batch is the
    mini-batch: its output is returned as it is."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(out)[0] for out in outputs]
    merged = [_merge_output(outputs[0], i, [leaves[i] for leaves in flat], rows)
              for i in range(len(flat[0]))]
    return pytree.tree_unflatten(merged, pytree.tree_flatten(outputs[0])[1])


def _merge_output(output: Any, i: int, parts: list[Any], rows: Sequence[int | None]) -> Any:
    """Leaf i of the output from its value in each micro-batch (see ``concat``)."""
    first = parts[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        known = [n for n in rows if n is not None]
        if rows and len(known) == len(rows):
            sizes = [int(p.size(0)) for p in parts]
            per_sample = {size / n for size, n in zip(sizes, known, strict=True)}
            if len(per_sample) == 1 and per_sample.pop().is_integer():
                return torch.cat(parts, dim=0)
            problem = (f"has {sizes} rows along dim 0 in micro-batches of {known} "
                       f"samples, not a number of rows per sample")
        else:
            return torch.cat(parts, dim=0)
    elif isinstance(first, torch.Tensor):
        # the mini-batch's mean is the mean of the micro-batches' only for equal ones
        problem = "is a 0-dim tensor (a mean or sum over the samples?)"
    elif all(p is first or _same(p, first) for p in parts):
        return first
    else:
        problem = f"differs between micro-batches ({first!r}, {parts[1]!r}, ...)"
    name = f"output{_leaf_paths(output)[i]}"
    raise ValueError(
        f"the model's {name} {problem}: the runner cannot rebuild the mini-batch's value "
        f"from its {len(parts)} micro-batches'; return per-sample values (one row per "
        f"sample) and reduce them after runner.forward, or compute it in loss_fn"
    )


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a truth value
        return False


def batch_size(value: Any) -> int | None:
    """Dim 0 of the first tensor leaf of ``value`` with dim > 0: its batch size
    (None without one)."""
    for x in pytree.tree_leaves(value):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.size(0))
    return None


def chunk_sizes(batch: int, r: int) -> list[int]:
    """The sizes ``torch.tensor_split`` gives ``batch`` samples split ``r`` ways."""
    q, rest = divmod(batch, r)
    return [q + 1 if i < rest else q for i in range(r)]


def split_replicas(inputs: Any, batch: int, r: int, *, whole: Collection[str] = ()) -> list[Any]:
    """One copy of ``inputs`` per replica: tensor leaves with dim 0 == ``batch`` split
    into r chunks along dim 0, every other leaf, and the values of a dict named in
    ``whole`` (shared graph inputs), passed whole to each replica."""
    if whole and isinstance(inputs, dict):
        kept = {name: v for name, v in inputs.items() if name in whole}
        rest = {name: v for name, v in inputs.items() if name not in whole}
        return [{**part, **kept} for part in split_replicas(rest, batch, r)]
    return split_leaves(inputs, r, lambda x: x.dim() > 0 and x.size(0) == batch)


def own_copies(chunks: list[dict[str, Any]], written: Collection[str]) -> list[dict[str, Any]]:
    """``chunks`` (``split_replicas`` of a stage's inputs) where each replica has its own
    copy of the graph inputs the stage writes in place (``written``): chunks of one tensor
    share its version counter, so one replica's write would break the backward of
    another's saved chunk, and an input passed whole would be written once per replica."""
    return [{**chunk, **{name: chunk[name].clone() for name in written
                         if isinstance(chunk.get(name), torch.Tensor)}} for chunk in chunks]


def written_back(chunks: list[dict[str, Any]], written: Collection[str],
                 whole: Collection[str]) -> dict[str, Any]:
    """The inputs in ``written`` as the replicas left them (``own_copies``), one value
    each for the stages that read them next: the chunks concatenated, or replica 0's
    copy of an input passed whole (each replica wrote the same)."""
    return {name: chunks[0][name] if name in whole else torch.cat([c[name] for c in chunks])
            for name in written if isinstance(chunks[0].get(name), torch.Tensor)}


def write_back(flat: Mapping[str, Any], values: Sequence[Mapping[str, Any]],
               written: Collection[str], shared: Collection[str]) -> None:
    """Copy the graph inputs the stages write in place (``written``), as each micro-batch's
    ``values`` hold them after a run, into the caller's tensors in ``flat`` (name ->
    value), as the model writes them: the micro-batches' rows concatenated, or micro-batch
    0's copy of a leaf each had whole (a shared input, a 0-dim tensor: each wrote the same)."""
    with torch.no_grad():
        for name in sorted(set(written) & set(flat)):
            parts = [pytree.tree_leaves(part[name]) for part in values]
            for i, x in enumerate(pytree.tree_leaves(flat[name])):
                if not isinstance(x, torch.Tensor):
                    continue
                batched = name not in shared and x.dim() > 0
                got = torch.cat([leaves[i] for leaves in parts]) if batched else parts[0][i]
                if got is not x:
                    x.copy_(got)


def rows_of(value: Any, lo: int, hi: int, rows: int, *, whole: Collection[str] = ()) -> Any:
    """Rows [lo, hi) of every tensor leaf whose dim 0 is the micro-batch's ``rows``
    (one replica's equal chunk), every other leaf, and the values of a dict named in
    ``whole`` (shared graph inputs), whole."""
    if whole and isinstance(value, dict):
        return {name: v if name in whole else rows_of(v, lo, hi, rows)
                for name, v in value.items()}

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.size(0) == rows:
            return x[lo:hi]
        return x

    return pytree.tree_map(cut, value)


def lane_share(value: Any, lane: int, lanes: int, *, microbatches: int, what: str,
               whole: Collection[int] = ()) -> Any:
    """Lane ``lane``'s rows of ``value``: every tensor leaf with dim > 0 cut into
    ``microbatches`` micro-batches along dim 0, each of them into ``lanes`` equal
    chunks (as ``split_replicas`` splits a replicated stage's inputs), and chunk
    ``lane`` of each, concatenated. Other leaves, and the tensors whose id is in
    ``whole`` (shared inputs), pass whole."""
    if lanes == 1:
        return value

    def share(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or id(x) in whole:
            return x
        if x.size(0) % (microbatches * lanes):
            raise ValueError(
                f"{what} has {x.size(0)} rows along dim 0, which do not split into "
                f"{microbatches} micro-batches of {lanes} equal replica chunks; use a batch "
                f"size that is a multiple of {microbatches * lanes}"
            )
        parts = split_microbatches(x, microbatches)
        return torch.cat([split_replicas(mb, mb.size(0), lanes)[lane] for mb in parts])

    return pytree.tree_map(share, value)
