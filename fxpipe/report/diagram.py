"""partition.dot / partition.svg: one Graphviz cluster and colour per stage.

Module level by default (a box per module at the block depth, per stage), op level
on request. Edges that cross a stage boundary are labelled with the bytes they carry.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping

import pydot
import torch.fx

from fxpipe import meta
from fxpipe.units import format_bytes, format_ms

__all__ = ["DiagramError", "partition_dot", "render_svg"]

PALETTE = ("#cfe2f3", "#d9ead3", "#fff2cc", "#f4cccc", "#d9d2e9", "#fce5cd", "#d0e0e3", "#ead1dc")


def _group(node: torch.fx.Node, level: str, depth: int) -> str:
    if level == "op":
        return node.name
    path = meta.MODULE.get(node).path
    return ".".join(path.split(".")[:depth]) if path else "(model)"


def partition_dot(
    gm: torch.fx.GraphModule,
    stage_of: Mapping[str, int],
    *,
    num_stages: int,
    level: str = "module",
    depth: int = 1,
    title: str = "",
) -> str:
    """The DOT source of the partition of ``gm`` given fine node name -> stage."""
    if level not in ("module", "op"):
        raise ValueError(f"unknown diagram level {level!r}; use 'module' or 'op'")
    graph = pydot.Dot(
        "partition", graph_type="digraph", rankdir="TB", label=title, fontname="Helvetica"
    )
    graph.set_node_defaults(
        shape="box", style="filled,rounded", fontname="Helvetica", fontsize="10"
    )
    clusters = [
        pydot.Cluster(
            f"stage{k}",
            label=f"stage {k}",
            style="filled",
            fillcolor="#f7f7f7",
            color=PALETTE[k % len(PALETTE)],
        )
        for k in range(num_stages)
    ]
    ops = [n for n in gm.graph.nodes if n.name in stage_of and n.op != "get_attr"]
    boxes: dict[tuple[int, str], list[torch.fx.Node]] = {}
    for node in ops:
        boxes.setdefault((stage_of[node.name], _group(node, level, depth)), []).append(node)
    ids = {key: f"n{i}" for i, key in enumerate(boxes)}
    for (k, name), members in boxes.items():
        seconds = sum(meta.TIME.get(n).forward_s + meta.TIME.get(n).backward_s for n in members)
        detail = f"{len(members)} ops, " if level == "module" else ""
        label = f"{name}\\n{detail}{format_ms(seconds)}"
        clusters[k].add_node(
            pydot.Node(ids[(k, name)], label=label, fillcolor=PALETTE[k % len(PALETTE)])
        )
    for cluster in clusters:
        graph.add_subgraph(cluster)  # type: ignore[arg-type]  # a Cluster is a Subgraph

    box_of = {n: (stage_of[n.name], _group(n, level, depth)) for n in ops}
    edges: dict[tuple[str, str], int] = {}
    for node in ops:
        for user in node.users:
            if user not in box_of or box_of[user] == box_of[node]:
                continue
            key = (ids[box_of[node]], ids[box_of[user]])
            crossing = box_of[user][0] != box_of[node][0]
            edges[key] = edges.get(key, 0) + (meta.SHAPE.get(node).nbytes if crossing else 0)
    for (src, dst), nbytes in edges.items():
        edge = pydot.Edge(src, dst)
        if nbytes:  # a cut edge: red, labelled with what crosses the boundary
            cut = {"label": format_bytes(nbytes), "color": "#cc0000", "fontcolor": "#cc0000"}
            for attribute, value in {**cut, "penwidth": "2"}.items():
                edge.set(attribute, value)
        graph.add_edge(edge)
    return str(graph.to_string())


class DiagramError(RuntimeError):
    """Graphviz failed to draw a diagram (its message is the error's)."""


def render_svg(dot_source: str) -> bytes | None:
    """The SVG Graphviz draws for ``dot_source``, or None where Graphviz is not installed;
    ``DiagramError`` where dot fails on it (dot's "trouble in init_rank" on some
    clustered graphs: GPT-2 XL in 32 interleaved stage modules drew, another split of it
    did not)."""
    dot = shutil.which("dot")
    if dot is None:
        return None
    # The source straight to Graphviz: parsing it back with pydot first took 20 s for a
    # 32-stage Llama-3-70B diagram that dot draws in one.
    done = subprocess.run([dot, "-Tsvg"], input=dot_source.encode(), capture_output=True,
                          check=False)
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        raise DiagramError(said[0] if said else f"dot exited with status {done.returncode}")
    return done.stdout
