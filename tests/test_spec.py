"""Problem specs as text (``ops.spec``), shared by ``ops.bench --custom`` and ``benchmarks/fused_sass.py``."""
import pytest

from ops.bench import parse_custom
from ops.spec import parse_problem_spec


def test_single_values_apply_to_every_axis_and_missing_fields_stay_unset():
    f = parse_problem_spec("1,2,32,56x56,7")
    assert (f["batch"], f["heads"], f["dim"], f["spatial"], f["kernel_size"]) == (1, 2, 32, (56, 56), (7, 7))
    assert f["stride"] is f["dilation"] is f["causal"] is None and f["rpb"] is False


def test_per_axis_values_and_rpb_flag():
    f = parse_problem_spec("2,16,64,16x32x32,5x7x7,1,1x2x2,1x0x0,1")
    assert f["stride"] == (1, 1, 1) and f["dilation"] == (1, 2, 2)
    assert f["causal"] == (True, False, False) and f["rpb"] is True


def test_bench_custom_problem_and_its_error():
    p = parse_custom("mine:2,8,64,64x64,13x13,1,1,0")
    assert (p.name, p.spatial, p.kernel_size, p.stride, p.dilation, p.causal) == (
        "mine", (64, 64), (13, 13), (1, 1), (1, 1), (False, False))
    with pytest.raises(ValueError, match="--custom: expected name:B,H,D"):
        parse_custom("bad:1,2")
