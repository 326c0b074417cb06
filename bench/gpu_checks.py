"""What only a GPU shows: the cost models against CUDA events, the generated runner
on CUDA streams, and each stage's peak memory against the plan.

The model is GPT-2 small (examples/gpt.py: 12 layers, width 768, 12 heads,
vocab 50257, tied LM head) with micro-batches of 2 × 1024 tokens.

1. ``cost``: every node timed with CUDA events (fxpipe's measured cost model,
   the median of 5 runs after 2 warm-ups) against the roofline of this GPU's
   row of the device table, in float32 and bfloat16. Also the whole unsplit
   forward + backward timed with CUDA events against the sums of the nodes.
2. ``stages``: fxpipe splits the float32 model into 4 stages (1F1B, M = 4) with
   the roofline; each generated stage's forward and backward timed alone with
   CUDA events against the plan's prediction. Then the same with a plan made from
   CUDA-event node times (``fxpipe split --measure``): which plan's slowest stage
   is faster in fact.
3. ``streams``: the generated runner with every stage on cuda:0, each on its own
   stream: loss and gradients against the unsplit model doing the same M
   micro-batches (``loss / M``, ``backward()``), and the step time of each,
   alternated over rounds.
4. ``memory``: stage k alone on the GPU, every other stage on the CPU, one
   runner step and one Adam step after a warm-up step:
   ``torch.cuda.max_memory_allocated`` against the plan's memory of stage k.
5. ``plan``: the plan's memory per stage by kind (also on the CPU: what part 4
   measures against, e.g. after a change to the memory model).

    python bench/gpu_checks.py --out gpu-results
    python bench/gpu_checks.py --parts plan --out plan-memory   # no GPU needed

Writes ``gpu_checks.json`` and prints a Markdown summary. ``--small`` runs the
same on the 4 × 128 test GPT (a smoke run, also on the CPU: parts 1–3 only).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Generated,
    load_gpt_example,
    paired_ratio,
    split_and_load,
    time_alternately,
    token_batch,
)

from fxpipe import meta
from fxpipe.cost_models import analytic, get_device, measured
from fxpipe.frontend import trace
from fxpipe.passes import annotate_all

MiB = 2**20


def device_row() -> str:
    """The device table's row for this GPU (h100 or h200), or cpu."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    for row in ("h200", "h100", "a100-80gb", "l4"):
        if row.split("-")[0].upper() in name:
            return row
    raise SystemExit(f"no device-table row for {name!r}")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def event_seconds(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 10) -> float:
    """Median seconds of ``fn``: CUDA events on a GPU, wall clock on the CPU."""
    clock = measured._Clock("cuda" if torch.cuda.is_available() else "cpu")
    return clock.median(fn, warmup=warmup, repeats=repeats)


def quantiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=10)
    return {"p10": cuts[0], "median": statistics.median(values), "p90": cuts[-1]}


# ------------------------------------------------------------------ 1. cost


def _is_matmul(node: torch.fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    text = f"{node.op}:{name}".lower()
    return any(k in text for k in ("linear", "matmul", "mm", "lm_head", "attn", "proj", "fc"))


def node_times(gm: torch.fx.GraphModule) -> dict[str, tuple[float, float]]:
    return {n.name: (meta.TIME.get(n).forward_s, meta.TIME.get(n).backward_s)
            for n in gm.graph.nodes if meta.TIME.has(n)}


def compare_costs(gpt: Any, cfg: Any, dtype: torch.dtype, row: str, dev: str) -> dict[str, Any]:
    """Per-node CUDA-event times against the roofline, and the whole step against both sums."""
    torch.manual_seed(0)
    with torch.device(dev):
        model = gpt.GPT(cfg).to(dtype)
    idx, target = token_batch(cfg.vocab_size, cfg.batch_size, cfg.seq_len, device=dev)
    traced = trace(model, (idx,))
    annotate_all(traced.gm, *traced.flat_inputs)
    analytic.annotate_times(traced.gm, get_device(row))
    roofline = node_times(traced.gm)
    measured.annotate_times(traced.gm, *traced.flat_inputs, device=dev.split(":")[0])
    events = node_times(traced.gm)
    kind = {n.name: "matmul" if _is_matmul(n) else "other" for n in traced.gm.graph.nodes}

    def whole_step() -> None:
        model.zero_grad(set_to_none=True)
        gpt.loss_fn(model(idx), target).backward()

    whole = event_seconds(whole_step, warmup=3, repeats=10)
    result: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "nodes": {}}
    for phase, i in (("forward", 0), ("backward", 1)):
        for group in ("all", "matmul", "other"):
            names = [n for n, t in roofline.items()
                     if t[i] > 0 and events[n][i] > 0 and group in ("all", kind[n])]
            if len(names) < 2:
                continue
            ratios = [events[n][i] / roofline[n][i] for n in names]
            result["nodes"][f"{phase}/{group}"] = {
                "count": len(names),
                "roofline_s": sum(roofline[n][i] for n in names),
                "measured_s": sum(events[n][i] for n in names),
                "ratio": quantiles(ratios),
            }
    result["whole_step_s"] = whole
    result["sum_roofline_s"] = sum(f + b for f, b in roofline.values())
    result["sum_measured_s"] = sum(f + b for f, b in events.values())
    return result


# ------------------------------------------------------------------ 2. stages


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().requires_grad_(True)
    return x


def time_stages(gen: Generated, model: nn.Module, idx: torch.Tensor) -> list[dict[str, float]]:
    """Each generated stage alone: forward, and backward with respect to its inputs
    and parameters with all-ones output gradients; CUDA-event medians."""
    package = gen.package
    stages = package.build_stages(model)
    values = package.runner.flatten_inputs(idx)
    rows = []
    for k, stage in enumerate(stages):
        inputs = {name: _leaf(values[name]) for name in stage.INPUTS}
        wrt = [x for x in tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
        wrt += [p for p in stage.parameters() if p.requires_grad]
        forward_s = event_seconds(lambda stage=stage, inputs=inputs: stage(**inputs))
        outputs = stage(**inputs)
        grown = [y for y in tree_leaves(outputs)
                 if isinstance(y, torch.Tensor) and y.grad_fn is not None]

        def backward(grown: list[torch.Tensor] = grown, wrt: list[torch.Tensor] = wrt) -> object:
            return torch.autograd.grad(grown, wrt, [torch.ones_like(y) for y in grown],
                                       retain_graph=True, allow_unused=True)

        backward_s = event_seconds(backward)
        planned = gen.plan.stages[k]
        rows.append({"stage": k, "forward_s": forward_s, "backward_s": backward_s,
                     "planned_forward_s": planned.forward_s,
                     "planned_backward_s": planned.backward_s})
        values.update(zip(stage.OUTPUTS, (_detached(y) for y in outputs), strict=True))
    return rows


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


# ------------------------------------------------------------------ 3. streams


def check_streams(gpt: Any, gen: Generated, model: nn.Module, idx: torch.Tensor,
                  target: torch.Tensor, dev: str, rounds: int) -> dict[str, Any]:
    """The runner with every stage on ``dev`` (own streams there) against the unsplit model."""
    package = gen.package
    num_stages = len(gen.plan.stages)
    m = gen.plan.microbatches
    runner = package.PipelineRunner(package.build_stages(model), devices=[dev] * num_stages)
    streams = {id(s) for s in runner.streams.compute if s is not None}

    def accumulate() -> float:
        total = torch.zeros((), device=idx.device)
        for x_m, y_m in zip(idx.tensor_split(m), target.tensor_split(m), strict=True):
            loss = gpt.loss_fn(model(x_m), y_m) / m
            loss.backward()
            total += loss.detach()
        return total.item()

    def pipelined() -> float:
        return runner.step((idx,), target, gpt.loss_fn).item()

    model.zero_grad(set_to_none=True)
    want_loss = accumulate()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = pipelined()
    sync()
    errors = []
    for name, p in model.named_parameters():
        scale = want[name].abs().max().item() or 1.0
        errors.append((p.grad - want[name]).abs().max().item() / scale)
    times = time_alternately([("unsplit", accumulate), ("runner", pipelined)], rounds,
                             before=lambda: model.zero_grad(set_to_none=True), sync=sync)
    return {
        "streams": len(streams),
        "loss": loss,
        "unsplit_loss": want_loss,
        "max_relative_grad_error": max(errors),
        "unsplit_s": statistics.median(times["unsplit"]),
        "runner_s": statistics.median(times["runner"]),
        "paired_ratio": paired_ratio(times, "runner", "unsplit"),
    }


# ------------------------------------------------------------------ 4. memory


@contextlib.contextmanager
def peak_memory() -> Iterator[dict[str, int]]:
    """Bytes allocated on the GPU at entry, and the peak while inside."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    figures = {"start": torch.cuda.memory_allocated()}
    yield figures
    torch.cuda.synchronize()
    figures["peak"] = torch.cuda.max_memory_allocated()


def stage_memory(gpt: Any, cfg: Any, gen: Generated, k: int, idx: torch.Tensor,
                 target: torch.Tensor) -> dict[str, Any]:
    """Stage k on cuda:0, the others on the CPU: its peak over a runner step and an Adam step."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    package = gen.package
    num_stages = len(gen.plan.stages)
    devices = ["cuda:0" if j == k else "cpu" for j in range(num_stages)]
    before = torch.cuda.memory_allocated()
    runner = package.PipelineRunner(package.build_stages(model, devices), devices=devices)
    owned = set(gen.plan.stages[k].parameters)
    params = [p for n, p in model.named_parameters() if n in owned]
    for p in params:  # a tied weight also held by a CPU stage was moved back by it
        p.data = p.data.to("cuda:0")
    optimizer = torch.optim.Adam(params, lr=1e-5)
    for _ in range(2):  # the first step creates Adam's state; the second is measured
        optimizer.zero_grad(set_to_none=True)
        with peak_memory() as seen:
            runner.step((idx,), target, gpt.loss_fn)
            optimizer.step()
    planned = gen.plan.stages[k].memory
    row = {"stage": k, "static_bytes": seen["start"] - before,
           "peak_bytes": seen["peak"] - before, "planned": dict(vars(planned)),
           "planned_total": planned.total}
    del runner, optimizer, params, model
    return row


# ------------------------------------------------------------------ main


def summary(results: dict[str, Any]) -> str:
    lines = [f"device: {results['device']} (table row {results['row']}), "
             f"torch {results['torch']}", ""]
    if results["cost"]:
        lines += ["| dtype | phase/ops | nodes | roofline | CUDA events "
                  "| ratio p10 / median / p90 |", "|---|---|---:|---:|---:|---|"]
    for cost in results["cost"]:
        for key, row in cost["nodes"].items():
            q = row["ratio"]
            lines.append(f"| {cost['dtype']} | {key} | {row['count']} | "
                         f"{row['roofline_s'] * 1e3:.2f} ms | {row['measured_s'] * 1e3:.2f} ms | "
                         f"{q['p10']:.2f} / {q['median']:.2f} / {q['p90']:.2f} |")
    lines.append("")
    for cost in results["cost"]:
        lines.append(f"{cost['dtype']} whole forward+backward (CUDA events): "
                     f"{cost['whole_step_s'] * 1e3:.2f} ms; sum of nodes measured "
                     f"{cost['sum_measured_s'] * 1e3:.2f} ms, roofline "
                     f"{cost['sum_roofline_s'] * 1e3:.2f} ms")
    if results["stages"]:
        lines += ["", "| stage | forward: plan / measured | backward: plan / measured |",
                  "|---:|---|---|"]
    for row in results["stages"]:
        lines.append(f"| {row['stage']} | {row['planned_forward_s'] * 1e3:.2f} / "
                     f"{row['forward_s'] * 1e3:.2f} ms | {row['planned_backward_s'] * 1e3:.2f} / "
                     f"{row['backward_s'] * 1e3:.2f} ms |")
    for key, title in (("stages", "roofline plan"), ("measured_plan_stages", "measured plan")):
        rows = results.get(key)
        if rows:
            slowest = max(r["forward_s"] + r["backward_s"] for r in rows)
            planned = max(r["planned_forward_s"] + r["planned_backward_s"] for r in rows)
            lines.append(f"{title}: slowest stage measured {slowest * 1e3:.2f} ms "
                         f"(planned {planned * 1e3:.2f} ms); stage times "
                         + ", ".join(f"{(r['forward_s'] + r['backward_s']) * 1e3:.2f}"
                                     for r in rows) + " ms")
    s = results["streams"]
    if s:
            lines += ["", f"streams: {s['streams']} stage streams; loss {s['loss']:.6f} vs unsplit "
                  f"{s['unsplit_loss']:.6f}; max relative gradient error "
                  f"{s['max_relative_grad_error']:.2e}; step {s['runner_s'] * 1e3:.1f} ms vs "
                  f"unsplit {s['unsplit_s'] * 1e3:.1f} ms, per-round ratio {s['paired_ratio']:.3f}"]
    if results.get("memory"):
        lines += ["", "| stage | plan: params+grads+optimizer | plan: activations+received"
                  "+outputs+loss+backward+workspace | plan total | measured static | measured peak "
                  "| peak / plan |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for row in results["memory"]:
            p = row["planned"]
            static = p["params"] + p["grads"] + p["optimizer"]
            dynamic = (p["activations"] + p["received"] + p.get("outputs", 0) + p.get("loss", 0)
                       + p.get("backward", 0) + p["workspace"] + p["stashed"])
            lines.append(f"| {row['stage']} | {static / MiB:.0f} MiB | {dynamic / MiB:.0f} MiB | "
                         f"{row['planned_total'] / MiB:.0f} MiB | "
                         f"{row['static_bytes'] / MiB:.0f} MiB | {row['peak_bytes'] / MiB:.0f} MiB"
                         f" | {row['peak_bytes'] / row['planned_total']:.2f} |")
    if results.get("plan"):
        kinds = ("activations", "received", "outputs", "loss", "backward")
        lines += ["", "| stage | plan: params+grads+optimizer | " + " | ".join(kinds)
                  + " | plan total |", "|---:|" + "---:|" * (len(kinds) + 2)]
        for k, p in enumerate(results["plan"]):
            static = p["params"] + p["grads"] + p["optimizer"]
            lines.append(f"| {k} | {static / MiB:.0f} MiB | "
                         + " | ".join(f"{p[kind] / MiB:.0f} MiB" for kind in kinds)
                         + f" | {p['total'] / MiB:.0f} MiB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-results"))
    parser.add_argument("--small", action="store_true", help="the 4 x 128 test GPT (smoke run)")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--parts", default="cost,stages,streams,memory,plan")
    args = parser.parse_args()
    parts = set(args.parts.split(","))

    gpt = load_gpt_example()
    cfg = gpt.SMALL if args.small else gpt.GPT2_SMALL
    row = device_row()
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev != "cpu" else "cpu",
        "row": row, "torch": torch.__version__,
        "model": f"GPT {cfg.n_layer}x{cfg.n_embd}, micro-batch {cfg.batch_size}x{cfg.seq_len}",
        "cost": [], "stages": [], "streams": {}, "memory": [], "plan": [],
    }
    if "cost" in parts:
        for dtype in (torch.float32, torch.bfloat16):
            print(f"cost model, {dtype}", flush=True)
            results["cost"].append(compare_costs(gpt, cfg, dtype, row, dev))

    m = args.microbatches
    micro = token_batch(cfg.vocab_size, cfg.batch_size, cfg.seq_len)[0]
    torch.manual_seed(0)
    model = gpt.GPT(cfg)  # real weights on the CPU: traced and planned there
    gen = split_and_load(model, (micro,), stages=args.stages, microbatches=m,
                         device=row if row != "cpu" else "h100")
    print(f"plan: {[len(s.nodes) for s in gen.plan.stages]} ops per stage", flush=True)
    if "plan" in parts:  # the plan's memory by kind: what part 4 measures against (any device)
        results["plan"] = [{**vars(s.memory), "total": s.memory.total} for s in gen.plan.stages]
    idx, target = token_batch(cfg.vocab_size, cfg.batch_size * m, cfg.seq_len, seed=1)
    model.to(dev)
    if "stages" in parts:
        print("stage times", flush=True)
        results["stages"] = time_stages(gen, model, micro.to(dev))
        if dev != "cpu":
            print("stage times of a plan from measured node times", flush=True)
            by_events = split_and_load(model, (micro.to(dev),), stages=args.stages,
                                       microbatches=m, device=row, measure=True)
            results["measured_plan_stages"] = time_stages(by_events, model, micro.to(dev))
    if "streams" in parts:
        print("runner on streams", flush=True)
        results["streams"] = check_streams(gpt, gen, model, idx.to(dev), target.to(dev), dev,
                                           args.rounds)
    del model
    if "memory" in parts and dev != "cpu":
        for k in range(args.stages):
            print(f"memory of stage {k}", flush=True)
            results["memory"].append(stage_memory(gpt, cfg, gen, k, idx, target))

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_checks.json").write_text(json.dumps(results, indent=2) + "\n")
    text = summary(results)
    (args.out / "gpu_checks.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
