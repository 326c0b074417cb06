import dataclasses

import pytest

from fxpipe.cost_models import DEVICES, Device, UnknownDeviceError, get_device

REQUIRED = ("h100", "h200", "a100-40gb", "a100-80gb", "v100", "l4", "cpu")


@pytest.mark.parametrize("name", REQUIRED)
def test_table_has_every_required_device_with_positive_figures(name: str) -> None:
    device = DEVICES[name]
    assert device.name == name
    assert device.peak_flops("float32") > 0
    for value in (
        device.memory_bandwidth,
        device.memory_bytes,
        device.intra_node_bandwidth,
        device.inter_node_bandwidth,
    ):
        assert value > 0
    assert device.intra_node_bandwidth >= device.inter_node_bandwidth


def test_lookup_is_case_insensitive_and_knows_aliases() -> None:
    assert get_device("H100") is DEVICES["h100"]
    assert get_device("a100") is DEVICES["a100-80gb"]
    assert get_device("A100-40GB") is DEVICES["a100-40gb"]
    assert get_device("a100_40gb") is DEVICES["a100-40gb"]


def test_unknown_device_lists_the_known_ones() -> None:
    with pytest.raises(UnknownDeviceError) as info:
        get_device("h900")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'h900'" in message
    assert "a100-40gb" in message and "h100" in message
    assert "\n" not in message


def test_float32_uses_fp32_peak_unless_tf32_is_allowed() -> None:
    h100 = DEVICES["h100"]
    assert h100.peak_flops("float32") == 67e12
    assert h100.peak_flops("float32", allow_tf32=True) == 494.5e12
    assert h100.peak_flops("bfloat16") == 989.5e12


def test_missing_dtype_falls_back_to_float32() -> None:
    v100 = DEVICES["v100"]
    assert v100.peak_flops("bfloat16") == v100.peak_flops("float32")
    assert v100.peak_flops("int64") == v100.peak_flops("float32")
    # No TF32 on a V100: allow_tf32 changes nothing.
    assert v100.peak_flops("float32", allow_tf32=True) == v100.peak_flops("float32")


def test_device_is_frozen_and_hashable() -> None:
    h100 = DEVICES["h100"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        h100.name = "x"  # type: ignore[misc]
    assert {h100: 1}[h100] == 1
    assert isinstance(h100, Device)
