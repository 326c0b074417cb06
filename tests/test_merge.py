"""fxpipe merge refuses, in one line and writing nothing, what would not load as the
model's checkpoint: diverged copies of a tied weight, keys no stage holds, copies of a
key that differ, and files that are not a stage's state_dict."""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.plan import Plan
from fxpipe.runtime import import_file, load_package
from tests._cli import Ran, fxpipe

# A tied embedding and head on two stages, and a BatchNorm's buffers.
MODEL = """
import torch


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 16)
        self.body = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(3)
        self.head = torch.nn.Linear(16, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.norm(torch.relu(self.body(self.emb(tokens)))))


def build_model():
    torch.manual_seed(0)
    return Tied()


def example_inputs():
    return (torch.zeros(4, 3, dtype=torch.long),)
"""

SAVE = "save each stage with torch.save(stage.state_dict(), path)"


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """The folder fxpipe split wrote for the tied model on 2 GPUs, and the model."""
    work = tmp_path_factory.mktemp("tied")
    (work / "model.py").write_text(MODEL)
    done = fxpipe("split", "model.py", "--gpus", "2", "--pp", "2", "--out", "pipe", cwd=work)
    assert done.returncode == 0, done.stderr
    return work / "pipe", import_file(work / "model.py", "merge_tied_model").build_model()


def stage_states(folder: Path, model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    stages = load_package(folder).build_stages(model)
    return [{k: v.clone() for k, v in stage.state_dict().items()} for stage in stages]


def merge(folder: Path, states: list[object], *flags: str | Path) -> Ran:
    """``fxpipe merge`` of ``states`` saved as stage0.pt, stage1.pt ... in ``folder``."""
    names = [f"stage{k}.pt" for k in range(len(states))]
    for name, state in zip(names, states, strict=True):
        torch.save(state, folder / name)
    return fxpipe("merge", *names, "--out", "model.pt", *flags, cwd=folder)


def refused(ran: Ran, folder: Path) -> str:
    """The one line a refusal printed, after checking it wrote nothing."""
    lines = ran.stderr.strip().splitlines()
    assert ran.returncode == 2 and len(lines) == 1, ran.stderr
    assert not (folder / "model.pt").exists()
    assert lines[0].startswith("fxpipe: error: ")
    return lines[0].removeprefix("fxpipe: error: ")


def test_the_plan_lists_every_key_the_stages_hold_grouped_by_tensor(tied, tmp_path) -> None:
    folder, model = tied
    plan = Plan.from_json((folder / "plan.json").read_text())
    states = stage_states(folder, model)
    assert sorted(k for group in plan.state_keys for k in group) == sorted(set().union(*states))
    assert [g for g in plan.state_keys if len(g) > 1] == [("emb.weight", "head.weight")]
    # the stages' checkpoints merge against it into one a strict load_state_dict takes
    done = merge(tmp_path, states, "--plan", folder)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)


def test_diverged_copies_of_a_tied_weight_under_two_names_are_refused(tied, tmp_path) -> None:
    folder, model = tied
    first, last = stage_states(folder, model)
    assert "emb.weight" in first and "head.weight" in last
    last["head.weight"] += 1
    line = refused(merge(tmp_path, [first, last], "--plan", folder), tmp_path)
    assert line == ("the tied parameter 'emb.weight' in stage 0 and 'head.weight' in stage 1 "
                    "differ (largest difference 1); its copies must be equal: synchronize "
                    "them before saving (copy one stage's into the other's)")


def test_keys_no_stage_of_the_plan_holds_are_refused(tied, tmp_path) -> None:
    folder, model = tied
    first, last = stage_states(folder, model)
    last.update({"step": torch.tensor(3), "ema.head.weight": last["head.weight"]})
    line = refused(merge(tmp_path, [first, last], "--plan", folder), tmp_path)
    assert line == ("stage1.pt holds 2 keys that no stage of the plan holds (first: 'step', "
                    "'ema.head.weight'), which a strict load_state_dict refuses; save only "
                    "each stage's state_dict(), or delete them")
    # and the keys it names are those a strict load refuses
    merged = {**first, **last}
    with pytest.raises(RuntimeError, match=r'Unexpected key.*"step", "ema\.head\.weight"'):
        model.load_state_dict(merged, strict=True)


@pytest.mark.parametrize(("other", "differs"), [
    (torch.zeros(16, 16, dtype=torch.float64), "dtypes float32 and float64"),
    (torch.zeros(16, 8), "shapes (16, 16) and (16, 8)"),
    (torch.zeros(8, dtype=torch.int64), "dtypes float32 and int64; shapes (16, 16) and (8,)"),
    (torch.full((16, 16), 0.25), "largest difference 0.25"),
    (torch.zeros(16, 16).index_fill_(0, torch.tensor([3]), float("nan")),
     "largest difference nan"),
])
def test_differing_copies_of_a_key_say_what_differs_and_are_not_called_tied(
    tmp_path: Path, other: torch.Tensor, differs: str
) -> None:
    line = refused(merge(tmp_path, [{"w": torch.zeros(16, 16)}, {"w": other}]), tmp_path)
    assert line == (f"'w' differs between stage 0 and stage 1 ({differs}); a key several "
                    "stages hold must be the same tensor in each: save the stages of one "
                    "model, or synchronize the copies before saving")


def test_copies_equal_up_to_their_nans_merge(tmp_path: Path) -> None:
    nan = torch.tensor([1.0, float("nan")])
    done = merge(tmp_path, [{"w": nan}, {"w": nan.clone()}])
    assert done.returncode == 0, done.stderr


class Payload:
    """A pickled object: loading it would run this module's code."""


UNLOADABLE = {  # file -> what merge says of it
    "a pickled object": (
        lambda path: torch.save(Payload(), path),
        f"not a stage's state_dict: it holds pickled Python objects ({__name__}.Payload), "
        f"which torch.load(weights_only=True) does not load; {SAVE}"),
    "a plain pickle": (  # pickle.dump's protocol, which torch's unpickler warns about
        lambda path: path.write_bytes(pickle.dumps({"w": [1.0]}, protocol=4)),
        "not a stage's state_dict: it holds a pickle torch.save did not write, which "
        f"torch.load(weights_only=True) does not load; {SAVE}"),
    "text": (lambda path: path.write_text("w = 1\n"),
             f"not a file torch.save wrote (UnpicklingError); {SAVE}"),
    "other text": (lambda path: path.write_text("hello"),
                   f"not a file torch.save wrote (KeyError); {SAVE}"),
    "nothing": (lambda path: path.write_bytes(b""),
                f"not a file torch.save wrote (EOFError); {SAVE}"),
}


@pytest.mark.parametrize("case", list(UNLOADABLE))
def test_a_file_torch_load_refuses_gets_one_line_and_no_warning(
    tmp_path: Path, case: str
) -> None:
    write, holds = UNLOADABLE[case]
    write(tmp_path / "stage0.pt")
    done = fxpipe("merge", "stage0.pt", "--out", "model.pt", cwd=tmp_path)
    assert refused(done, tmp_path) == f"stage0.pt: {holds}"


def test_an_optimizer_state_dict_is_refused(tmp_path: Path) -> None:
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    line = refused(merge(tmp_path, [optimizer.state_dict(), optimizer.state_dict()]), tmp_path)
    assert line == ("stage0.pt: not a stage's state_dict (a module's state_dict()): it holds "
                    f"an optimizer's state_dict ('state', 'param_groups'); {SAVE}")


@pytest.mark.parametrize(("held", "words"), [
    ([torch.zeros(2)], "a list"),
    (torch.zeros(2), "a Tensor"),
    ({"w": 1}, "a dict whose 'w' is an int, not a tensor"),
    ({"w": torch.zeros(2), "epoch": "3"}, "a dict whose 'epoch' is a str, not a tensor"),
    ({"model": {"w": torch.zeros(2)}, "epoch": 3},
     "a dict whose 'model' is a state_dict (save that alone)"),
    ({0: torch.zeros(2)}, "a dict with the key 0 (an int, not a name)"),
])
def test_what_is_not_a_state_dict_is_named(tmp_path: Path, held: object, words: str) -> None:
    line = refused(merge(tmp_path, [{"w": torch.zeros(2)}, held]), tmp_path)
    assert line == (f"stage1.pt: not a stage's state_dict (a module's state_dict()): it holds "
                    f"{words}; {SAVE}")


def _is_state_dict(held: object) -> bool:
    return isinstance(held, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in held.items())


# what torch.load(weights_only=True) gives back: containers of numbers, strings and tensors
_leaves = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(-1, 1),
                    st.text(max_size=3), st.builds(torch.zeros, st.integers(0, 3)))
_held = st.recursive(_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.tuples(inner, inner),
    st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 3)), inner, max_size=3),
), max_leaves=6).filter(lambda held: not _is_state_dict(held))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(held=_held)
def test_anything_else_torch_loads_is_one_line_and_nothing_written(held: object) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        line = refused(merge(folder, [{"w": torch.zeros(2)}, held]), folder)
        assert line.startswith("stage1.pt: not a stage's state_dict (a module's state_dict()): "
                               "it holds ")
        assert line.endswith(SAVE)
