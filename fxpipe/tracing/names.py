"""Attribute names that are not Python identifiers, written as code can read them.

torch.fx prints a module path part by part, ``self.d.a`` where a part is an identifier
and ``getattr(self.d, "a-b")`` where it is not; but a Python keyword is an identifier
(``"class".isidentifier()``), so a child named ``class`` (``nn.ModuleDict({"class":
...})``) comes out as ``self.d.class``, a SyntaxError in torch's own recompile, under
``symbolic_trace`` and under ``torch.export``'s ``module()`` alike. A name holding a
quote breaks the getattr form the same way. ``install`` puts in torch.fx's place a
printer that reads such a part with ``getattr`` and a properly quoted string; every
name torch prints validly it prints as torch does, so the generated stages and every
graph fxpipe recompiles read as before. fxpipe's own code generator then writes the
getattr as an index or ``get_submodule`` (``codegen/statements.py``).
"""

from __future__ import annotations

import json
import keyword

import torch.fx.graph

__all__ = ["attribute_part", "install", "readable_target"]


def attribute_part(name: str) -> bool:
    """Whether ``.name`` reads attribute ``name``: an identifier that is no keyword."""
    return name.isidentifier() and not keyword.iskeyword(name)


def readable_target(base: str, target: str) -> str:
    """``base`` followed by the dotted ``target``, each part that ``attribute_part``
    refuses read with ``getattr`` (torch.fx's ``_format_target``, keywords and quotes
    included)."""
    text = base
    for part in target.split("."):
        text = f"{text}.{part}" if attribute_part(part) else \
            f"getattr({text}, {json.dumps(part, ensure_ascii=False)})"
    return text


def install() -> None:
    """Make torch.fx print targets with ``readable_target`` (idempotent)."""
    torch.fx.graph._format_target = readable_target
