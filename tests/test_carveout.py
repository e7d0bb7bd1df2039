"""The shared-memory carveout asked for a compiled kernel (``ops.fused.carveout``)."""
from ops.fused.carveout import CAPACITIES_KB, carveout_percent


def _capacity_chosen(percent):
    """The capacity the driver rounds a carveout percentage up to."""
    requested = percent * CAPACITIES_KB[-1] / 100
    return next(c for c in CAPACITIES_KB if c >= requested)


def test_smallest_capacity_holding_the_programs():
    # two programs of 98,640 bytes (plus 1 KB each for the driver) need 194.7 KB -> 196
    assert _capacity_chosen(carveout_percent(98_640, 2)) == 196
    # one program of 132,656 bytes (the Hopper dK/dV kernel's) -> 132
    assert _capacity_chosen(carveout_percent(132_656, 1)) == 132
    # more than the SM has: the largest
    assert carveout_percent(240_000, 1) == 100


def test_every_capacity_is_reachable():
    for kb in CAPACITIES_KB[1:]:
        shared = kb * 1024 - 1024  # exactly one program fits
        assert _capacity_chosen(carveout_percent(shared, 1)) == kb
        assert _capacity_chosen(carveout_percent(shared + 1, 1)) == CAPACITIES_KB[min(CAPACITIES_KB.index(kb) + 1,
                                                                                  len(CAPACITIES_KB) - 1)]
