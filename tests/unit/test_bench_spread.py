"""W7 over ``K`` pools (``pools.bench.spread``): which pool each cycle takes, and the
options that would leave a pool without traffic. No database, no clock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from pools.bench import core, spread

Pick = Callable[[int, int, int, int], int]


def shares(pick: Pick, procs: int, cycles: int, pools: int) -> Counter[int]:
    """Cycles per pool when ``procs`` processes each run ``cycles`` cycles."""
    return Counter(pick(p, c, procs, pools) for p in range(procs) for c in range(cycles))


def even(counts: Counter[int], pools: int) -> bool:
    """Every pool has traffic, and no pool has more than one cycle more than another."""
    values = [counts.get(k, 0) for k in range(pools)]
    return min(values) > 0 and max(values) - min(values) <= 1


@pytest.mark.parametrize(
    ("procs", "cycles", "pools"),
    [(1, 1000, 1000), (4, 25, 10), (16, 7, 100), (64, 16, 1000), (64, 2, 100), (3, 5, 7)],
)
def test_pick__every_pool_gets_an_even_share(procs: int, cycles: int, pools: int) -> None:
    assert even(shares(spread.pick, procs, cycles, pools), pools)


def test_pick__processes_start_on_different_pools() -> None:
    assert [spread.pick(p, 0, 16, 100) for p in range(16)] == list(range(16))


def test_pick__sabotage_picks_that_the_checks_above_reject() -> None:
    """The checks above can fail: a process that keeps to one pool (``proc mod K``) leaves
    ``K - N`` pools idle; a pick by cycle alone (``cycle mod K``) puts every process on
    the same pool at the same cycle."""

    def per_process(p: int, c: int, n: int, k: int) -> int:
        return p % k

    def per_cycle(p: int, c: int, n: int, k: int) -> int:
        return c % k

    assert not even(shares(per_process, 4, 25, 10), 10)
    assert [per_cycle(p, 0, 16, 100) for p in range(16)] != list(range(16))


def test_names__one_pool_keeps_its_name_numbered_ones_do_not_match_the_ballast() -> None:
    assert spread.names(1) == ["bench-core"]
    many = spread.names(1000)
    assert len(set(many)) == 1000 and many[0] == "bench-core-p0000"
    assert all(n.startswith(spread.PREFIX) for n in many)
    assert not "bench-core-ballast".startswith(spread.PREFIX)
    with pytest.raises(ValueError, match="at least one pool"):
        spread.names(0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pools", "0"], "at least one pool"),
        (["--pools", "10", "--depths", "0,1000"], "--depths fills one pool's line"),
        (["--procs", "4", "--cycles", "20", "--pools", "1,100"], "fewer cycles than pools"),
    ],
)
def test_main__refuses_options_that_leave_the_pools_unfair(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        core.main(argv)
    assert message in capsys.readouterr().err
