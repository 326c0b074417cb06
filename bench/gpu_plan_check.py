"""Plans against real training on one GPU: the report card before and after
``--calibrate``, and each stage's peak memory against the plan.

Each model is split into 4 stages (1F1B) by the ``fxpipe`` command, as a user would, and
the generated package trains it on cuda:0:

- ``gpt2``: examples/gpt.py's GPT-2 small (12 x 768, tied LM head), ``32-true``,
  M = 4 micro-batches of 2 x 1024 tokens;
- ``llama``: bench/hf_shapes.py's scaled transformers Llama (16 x 2048, 886M
  parameters, SDPA), ``bf16-mixed``, M = 8 micro-batches of 1 x 4096 tokens, with
  ``--memory 7GiB`` so that the solver has recompute to choose (on the h200 row: stages
  0-2 in full, stage 3 none; selective would keep more for no less time, its ops being
  too short to hide what torch's SAC costs the host);
- ``llama-selective``: the same Llama with ``--recompute selective`` and no memory limit:
  every stage under torch's SAC, keeping every matmul's and attention's output, its time
  as planned (SAC's host time included, ``Device.sac_dispatch``) against the measured.

Per model:

1. ``streams``: every stage on its own CUDA stream (the runner as it ships), three steps
   measured after a warm-up (``runner.measure``), and ``fxpipe report``. For the Llama,
   one more step under the allocator's trace: every block is charged to the stream that
   allocated it, so stage k's peak is its stream's peak plus its parameters and Adam
   state, against the plan's total less what the stage receives (on one GPU a received
   value is the sender's tensor, which the sender's figure already holds, not a copy).
2. ``one stream``: ``runner.measure(serial=True)`` runs every stage on one stream, so a
   stage's events time it alone, as on a GPU of its own -> ``measured.json`` beside the
   plan, and ``fxpipe report``. On one GPU the step is every stage's work in turn: the
   plan predicts it as M x sum_k (F_k + B_k) (nothing crosses a link; the report card
   says the same); that, and the slowest stage, against the measurement.
3. ``fxpipe split --calibrate measured.json``, and step 2 again on the calibrated plan:
   its predicted one-GPU step against the measured one.

    python bench/gpu_plan_check.py --out gpu-plan-check
    python bench/gpu_plan_check.py --small --out /tmp/smoke   # tiny models, also on the CPU

Writes ``results.json``, ``summary.md`` and each plan folder (with its measurements and
report cards) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import sys
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))
import hf_shapes  # noqa: E402
from _common import load_gpt_example, token_batch  # noqa: E402

from fxpipe.cli import main as fxpipe  # noqa: E402
from fxpipe.codegen import load_package  # noqa: E402
from fxpipe.plan import Plan  # noqa: E402
from fxpipe.report.card import compare  # noqa: E402
from fxpipe.runtime import load_measured  # noqa: E402

MiB = 2**20
STAGES = 4
STEPS = 3  # measured, after one warm-up step


@dataclass(frozen=True)
class Case:
    name: str
    spec: str  # model file and factory for `fxpipe split`
    flags: tuple[str, ...]
    microbatches: int
    build: Callable[[str], nn.Module]  # the same model on a device (weights need not match)
    batch: Callable[[int], tuple[Any, torch.Tensor]]  # a mini-batch of M micro-batches
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    memory: bool  # trace each stage's peak memory


def cases(small: bool) -> list[Case]:
    gpt = load_gpt_example()
    cfg = gpt.SMALL if small else gpt.GPT2_SMALL
    factory = "build_model" if small else "build_gpt2_small"

    def gpt_batch(m: int) -> tuple[Any, torch.Tensor]:
        ids, target = token_batch(1000, cfg.batch_size * m, cfg.seq_len, seed=1)
        return (ids,), target

    def gpt_model(device: str) -> nn.Module:
        with torch.device(device):
            return gpt.GPT(cfg)

    seq = 32 if small else 4096

    def llama_batch(m: int) -> tuple[Any, torch.Tensor]:
        ids, target = token_batch(1000, m, seq, seed=1)
        return {"input_ids": ids}, target

    if small:
        import transformers_models

        llama_spec = "examples/hf_llama.py"

        def llama_model(device: str) -> nn.Module:
            return transformers_models.build_llama().to(device)
    else:
        llama_spec = "bench/hf_shapes.py:build_llama_scaled"
        llama_model = hf_shapes.llama_scaled
    return [
        Case("gpt2", f"examples/gpt.py:{factory}", ("--precision", "32-true"), 4,
             gpt_model, gpt_batch, gpt.loss_fn, memory=False),
        Case("llama", llama_spec,
             ("--precision", "bf16-mixed", *(() if small else ("--memory", "7GiB"))), 8,
             llama_model, llama_batch, hf_shapes.loss_fn, memory=not small),
        Case("llama-selective", llama_spec, ("--precision", "bf16-mixed", "--recompute",
                                             "selective"), 8,
             llama_model, llama_batch, hf_shapes.loss_fn, memory=not small),
    ]


def cli(*argv: str) -> str:
    """``fxpipe ARGV`` in this process; its standard output; stops on a non-zero exit."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = fxpipe(list(argv))
    if status != 0:
        raise SystemExit(f"fxpipe {' '.join(argv)} exited {status}")
    return out.getvalue()


def split(case: Case, folder: Path, row: str, *extra: str) -> dict[str, Any]:
    cli("split", str(ROOT / case.spec), "--gpus", str(STAGES), "--pp", str(STAGES),
        "--microbatches",
        str(case.microbatches), "--device", row, "--out", str(folder), "--force",
        *case.flags, *extra)
    plan: dict[str, Any] = json.loads((folder / "plan.json").read_text())
    return plan


def stream_peaks(run: Callable[[], object], device: torch.device) -> dict[int, int]:
    """The most bytes live at once per CUDA stream while ``run`` runs, from the caching
    allocator's trace: a block counts from its allocation until its free completes, on
    the stream that allocated it."""
    torch.cuda.synchronize(device)
    # the history of every alloc and free, without tracebacks (cheap to record and read)
    torch.cuda.memory._record_memory_history("all", context=None, stacks="python",
                                             max_entries=10_000_000)
    try:
        run()
        torch.cuda.synchronize(device)
        trace = torch.cuda.memory._snapshot(device)["device_traces"][device.index or 0]
    finally:
        torch.cuda.memory._record_memory_history(None)
    live: dict[int, int] = defaultdict(int)
    peak: dict[int, int] = defaultdict(int)
    blocks: dict[int, tuple[int, int]] = {}  # address -> (stream, bytes), allocated in run
    for entry in trace:
        if entry["action"] == "alloc":
            blocks[entry["addr"]] = (entry["stream"], entry["size"])
            live[entry["stream"]] += entry["size"]
            peak[entry["stream"]] = max(peak[entry["stream"]], live[entry["stream"]])
        elif entry["action"] == "free_completed" and entry["addr"] in blocks:
            stream, size = blocks.pop(entry["addr"])
            live[stream] -= size
    assert peak, "the allocator's trace recorded no allocation"
    return dict(peak)


def train(case: Case, folder: Path, dev: str, *, one_stream: bool) -> dict[str, Any]:
    """Run the package in ``folder`` for a warm-up and STEPS measured steps; the card is
    saved beside the plan (``measured.json`` for one stream, else ``measured-streams.json``)
    and compared with it by ``fxpipe report``; with ``case.memory``, each stage's peak."""
    gc.collect()
    if dev != "cpu":
        torch.cuda.empty_cache()
    package = load_package(folder)
    torch.manual_seed(0)
    model = case.build(dev)
    runner = package.PipelineRunner(package.build_stages(model), devices=[dev] * STAGES)
    inputs, target = case.batch(case.microbatches)
    inputs = {k: v.to(dev) for k, v in inputs.items()} if isinstance(inputs, dict) \
        else tuple(x.to(dev) for x in inputs)
    target = target.to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = runner.step(inputs, target, case.loss_fn)
        optimizer.step()
        return float(loss)

    with runner.measure(warmup=1, serial=one_stream) as card:
        losses = [step() for _ in range(1 + STEPS)]
    name = "measured.json" if one_stream else "measured-streams.json"
    card.save(folder / name)
    result: dict[str, Any] = {"losses": losses, "card": card.to_dict(),
                              "report": cli("report", str(folder), str(folder / name))}
    if case.memory and not one_stream and dev != "cpu":
        optimizer.zero_grad(set_to_none=True)
        peaks = stream_peaks(lambda: runner.step(inputs, target, case.loss_fn),
                             torch.device(dev))
        stage_streams = [s.cuda_stream for s in runner.streams.compute]
        rows = []
        for k, stage in enumerate(runner.stages):
            params = list(stage.parameters())
            static = sum(p.numel() * p.element_size() for p in params)
            static += sum(t.numel() * t.element_size() for p in params
                          for t in optimizer.state.get(p, {}).values()
                          if isinstance(t, torch.Tensor))
            rows.append({"stage": k, "static_bytes": static,
                         "stream_peak_bytes": peaks.get(stage_streams[k], 0)})
        result["memory"] = rows
        result["other_streams_peak_bytes"] = max(
            (v for s, v in peaks.items() if s not in stage_streams), default=0)
    return result


def memory_table(plan: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| stage | recompute | plan total | plan less received | measured: static + "
             "stream peak | measured / plan less received |", "|---:|---|---:|---:|---:|---:|"]
    stages = Plan.from_dict(plan).stages
    for row, stage, planned in zip(rows, plan["stages"], stages, strict=True):
        mem = stage["memory"]
        want = mem["total"] - mem["received"]
        got = row["static_bytes"] + row["stream_peak_bytes"]
        lines.append(f"| {row['stage']} | {planned.recompute_mode} | "
                     f"{mem['total'] / MiB:.0f} MiB | {want / MiB:.0f} MiB | "
                     f"{row['static_bytes'] / MiB:.0f} + {row['stream_peak_bytes'] / MiB:.0f} = "
                     f"{got / MiB:.0f} MiB | {got / want:.3f} |")
    return lines


def stage_table(folder: Path, plan: dict[str, Any], card: dict[str, Any]) -> list[str]:
    """Per stage, planned against measured forward + backward; the slowest of each, and
    the step that the report card predicts for the plan in ``folder`` on one GPU."""
    lines = ["| stage | plan F + B | measured F + B (one stream) | measured / plan |",
             "|---:|---:|---:|---:|"]
    for stage, got in zip(plan["stages"], card["stages"], strict=True):
        want = stage["forward_s"] + stage["backward_s"]
        have = got["forward_s"] + got["backward_s"]
        lines.append(f"| {stage['index']} | {want * 1e3:.2f} ms | {have * 1e3:.2f} ms | "
                     f"{have / want:.2f} |")
    planned = max(plan["stages"], key=lambda s: s["forward_s"] + s["backward_s"])["index"]
    measured = max(card["stages"], key=lambda s: s["forward_s"] + s["backward_s"])["index"]
    predicted = compare(Plan.from_json((folder / "plan.json").read_text()),
                        load_measured(folder / "measured.json")).predicted_step_s
    step = card["step_s"]
    lines += ["", f"slowest stage (forward + backward): planned {planned}, measured {measured}; "
              f"one-GPU step: predicted {predicted * 1e3:.1f} ms, measured {step * 1e3:.1f} ms "
              f"(measured / predicted {step / predicted:.3f})"]
    return lines


def check(case: Case, out: Path, dev: str, row: str, result: dict[str, Any]) -> list[str]:
    """Steps 1-3 of the module docstring for ``case``; fills ``result``, returns Markdown."""
    folder, calibrated = out / case.name, out / f"{case.name}-calibrated"
    result["plan"] = plan = split(case, folder, row)
    result["streams"] = streams = train(case, folder, dev, one_stream=False)
    result["one_stream"] = alone = train(case, folder, dev, one_stream=True)
    result["calibrated_plan"] = plan_cal = split(case, calibrated, row, "--calibrate",
                                                 str(folder / "measured.json"))
    result["calibrated_one_stream"] = alone_cal = train(case, calibrated, dev, one_stream=True)
    lines = ["", f"## {case.name} ({' '.join(case.flags)}, M = {case.microbatches})", "",
             "### Stages on their own streams", "", streams["report"]]
    if "memory" in streams:
        lines += memory_table(plan, streams["memory"])
        lines.append(f"(largest peak on a stream of no stage: "
                     f"{streams['other_streams_peak_bytes'] / MiB:.0f} MiB)")
    return [*lines, "", "### One stream: each stage timed alone", "", alone["report"],
            *stage_table(folder, plan, alone["card"]), "", "### After --calibrate, one stream",
            "", alone_cal["report"], *stage_table(calibrated, plan_cal, alone_cal["card"])]


def device_row() -> str:
    if not torch.cuda.is_available():
        return "h100"  # a CPU smoke run plans for an H100 all the same
    name = torch.cuda.get_device_name()
    return "h200" if "H200" in name else "h100"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-plan-check"))
    parser.add_argument("--small", action="store_true", help="tiny models (a smoke run)")
    parser.add_argument("--only", nargs="*", help="cases to run (gpt2, llama, llama-selective)")
    args = parser.parse_args()
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    row = device_row()
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev != "cpu" else "cpu",
                               "row": row, "torch": torch.__version__, "cases": {}}
    lines = [f"device: {results['device']} (plans for the {row} row), torch {torch.__version__}"]
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every case: a failure later keeps what was measured
        (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        (args.out / "summary.md").write_text("\n".join(lines) + "\n")

    for case in cases(args.small):
        if args.only and case.name not in args.only:
            continue
        print(f"== {case.name}", flush=True)
        try:
            lines += check(case, args.out, dev, row, results["cases"].setdefault(case.name, {}))
        except Exception:  # the other case still runs; the error is recorded
            results["cases"][case.name]["error"] = traceback.format_exc()
            lines += ["", f"## {case.name}: failed", "", "```",
                      results["cases"][case.name]["error"], "```"]
        save()
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
