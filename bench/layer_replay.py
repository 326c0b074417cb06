"""symbolic_trace with alike layers replayed (``fxpipe/tracing/replay.py``) against tracing
every layer, on models fxpipe's tests did not write: the graph's code and every node's
name, target, type and ``meta`` must be the same; each model is built on meta without
weights. torchvision and timm are kept out of the project's environment (their wheels
pull a CUDA torch): run this in a venv of its own, with fxpipe on the path::

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch torchvision timm rich ortools
    PYTHONPATH=$PWD /tmp/tv/bin/python bench/layer_replay.py

GPipe's Transformer-L (``bench/gpipe_transformer.py``) is checked too, and timed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fxpipe.tracing.replay import LayerReplay
from fxpipe.tracing.symbolic import _traced

TORCHVISION = ("resnet152", "resnet50", "vit_b_16", "swin_t", "convnext_tiny",
               "efficientnet_b0", "mobilenet_v2", "regnet_y_400mf", "densenet121", "vgg16",
               "maxvit_t", "mnasnet1_0", "shufflenet_v2_x1_0", "wide_resnet50_2",
               "resnext50_32x4d", "swin_v2_t", "squeezenet1_0", "googlenet")
TIMM = ("vit_tiny_patch16_224", "deit_small_patch16_224", "convnext_atto", "resnet50d",
        "efficientnet_b0", "mixer_s16_224", "swin_tiny_patch4_window7_224", "regnety_002",
        "cait_xxs24_224", "beit_base_patch16_224", "poolformer_s12", "resmlp_12_224",
        "levit_128", "gmlp_s16_224", "xcit_nano_12_p16_224", "pit_ti_224", "coat_lite_tiny",
        "convmixer_768_32", "mobilevitv2_050", "eva02_tiny_patch14_224", "hrnet_w18_small",
        "dla34", "tresnet_m", "nfnet_l0", "crossvit_tiny_240", "volo_d1_224")


def _nodes(gm: torch.fx.GraphModule) -> list[tuple[object, ...]]:
    return [(n.name, n.op, n.target, n.type, n.meta) for n in gm.graph.nodes]


def check(name: str, build: Callable[[], torch.nn.Module]) -> bool | None:
    """Trace a model built afresh both ways (tracing runs forward, which may change it);
    print the line and say whether the graphs are the same (None: not traced)."""
    try:
        model = build().eval()
        replay = LayerReplay(model)
        start = time.process_time()
        replayed = _traced(model, replay)
        fast = time.process_time() - start
        model = build().eval()
        start = time.process_time()
        whole = _traced(model, LayerReplay(model, enabled=False))
        slow = time.process_time() - start
    except Exception as exc:  # the model's own tracing failure, reported
        print(f"{name}: not traced ({type(exc).__name__}: {str(exc)[:80]})", flush=True)
        return None
    same = replayed.code == whole.code and _nodes(replayed) == _nodes(whole)
    print(f"{name}: {len(whole.graph.nodes)} nodes, {replay.replayed} layers replayed, "
          f"{'the same graph' if same else 'GRAPHS DIFFER'}; {fast:.2f} s against "
          f"{slow:.2f} s", flush=True)
    return same


def _models() -> list[tuple[str, Callable[[], torch.nn.Module]]]:
    sys.path.insert(0, str(Path(__file__).parent))
    import gpipe_transformer

    models: list[tuple[str, Callable[[], torch.nn.Module]]] = [
        (f"Transformer-L {n}", gpipe_transformer.layers(n)) for n in (8, 50, 1663)]
    try:
        import timm
        import torchvision.models as tvm
    except ImportError as exc:
        print(f"torchvision and timm skipped: {exc}")
        return models

    def on_meta(make: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
        def build() -> torch.nn.Module:
            with torch.device("meta"):
                return make()
        return build

    models += [(f"torchvision {n}", on_meta(getattr(tvm, n))) for n in TORCHVISION]
    models += [(f"timm {n}", on_meta(lambda n=n: timm.create_model(n, pretrained=False)))
               for n in TIMM]
    return models


def main() -> int:
    results = [check(name, build) for name, build in _models()]
    traced = [same for same in results if same is not None]
    print(f"{sum(traced)} of {len(traced)} traced the same ({len(results) - len(traced)} "
          f"not traced)")
    return 0 if all(traced) else 1


if __name__ == "__main__":
    raise SystemExit(main())
