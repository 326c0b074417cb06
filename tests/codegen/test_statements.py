"""fx's forward as hand-written lines: how a parameter or buffer read is written."""

from __future__ import annotations

from fxpipe.codegen.statements import forward_lines
from fxpipe.codegen.wrap import LINE_LENGTH
from fxpipe.cut import StageIO


def _written(read: str, name: str, index: bool = True) -> list[str]:
    """The lines for ``name = <read>`` (fx's text) in a forward that returns it, with a
    shape comment and the full-name fallback a stage has for every state read."""
    src = f"def forward(self):\n    {name} = {read}\n    return ({name},)\n"
    full = f'self.get_parameter("{name.replace("_", ".")}")'
    lines, _ = forward_lines(
        src, StageIO(0, (), (name,), ()), {name: "float32[64, 64]"}, {name: full},
        index=(lambda parent, child: f"[{child}]") if index else None,
    )
    return lines[2:-1]  # between the docstring and the return


def test_a_state_read_is_attributes_and_indices_with_its_comment_where_it_fits() -> None:
    assert _written('getattr(self.h, "0").w', "h_0_w") == [
        "        h_0_w = self.h[0].w  # float32[64, 64]"
    ]


def test_a_state_read_too_long_for_its_comment_keeps_one_line_without_it() -> None:
    name = "model_layers_0_self_attn_q_proj_weight"
    lines = _written('getattr(self.model.layers, "0").self_attn.q_proj.weight', name)
    assert lines == [f"        {name} = self.model.layers[0].self_attn.q_proj.weight"]
    assert len(lines[0]) <= LINE_LENGTH < len(lines[0] + "  # float32[64, 64]")


def test_a_state_read_too_long_for_a_line_is_parenthesized() -> None:
    name = "model_layers_0_post_attention_layernorm_weight"
    assert _written('getattr(self.model.layers, "0").post_attention_layernorm.weight',
                    name) == [
        f"        {name} = (",
        "            self.model.layers[0].post_attention_layernorm.weight",
        "        )",
    ]


def test_a_state_read_nothing_indexes_is_by_its_full_name() -> None:
    assert _written('getattr(self.h, "0").w', "h_0_w", index=False) == [
        '        h_0_w = self.get_parameter("h.0.w")  # float32[64, 64]'
    ]
