"""``benchmarks/fused_sass.py``: the portable kernels compiled offline for sm_90 the way the launcher compiles them."""
import importlib.util
import os
import subprocess
import sys

from ops.fused import tiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fused_sass():
    spec = importlib.util.spec_from_file_location("fused_sass", os.path.join(ROOT, "benchmarks", "fused_sass.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Kernel:
    arg_names = ("sqb", "sqt", "sqh", "slb", "slt")


def test_boxes_argument_matches_the_launchers_count_for_unstrided_windows():
    fused_sass = _fused_sass()
    for spatial, kernel, outer, inner in [((56, 56), (7, 7), (2, 8), (4, 16)), ((16, 32, 32), (5, 7, 7), (4, 2, 8),
                                                                                 (4, 8, 2))]:
        ints = fused_sass.int_arguments(_Kernel, 2, 4, 32, spatial, kernel, (1,) * len(spatial), (1,) * len(spatial),
                                        fused_sass.pad3(outer, 1), fused_sass.pad3(inner, 1))
        axes = [tiles.Axis(length, k, 1) for length, k in zip(spatial, kernel)]
        assert ints["BOXES"] == tiles.max_boxes(axes, outer, inner), (spatial, kernel)
        assert ints["sqt"] == 4 * 32 and ints["slt"] == 4


def test_command_reports_a_kernel_with_bias_tiles():
    """The script's own command (bias tiles use every integer argument of the forward, ``BOXES`` included)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "benchmarks/fused_sass.py", "128,2,32,56x56,7x7,1,1,0,1", "--outer",
                          "1x2x8", "--inner", "1x4x16", "--warps", "1", "--maxnreg", "112", "--tma", "--host-desc",
                          "--rpb"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "total" in run.stdout and "programs per SM" in run.stdout.splitlines()[-1]
