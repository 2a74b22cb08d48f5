"""The tree the departures at exit travel (mpigrad/_comm/departures.py)."""

import math

import pytest

from mpigrad._comm.departures import Spread, children, pack, parent, reach, subtree, unpack


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 17, 32, 1000])
def test_every_rank_hangs_from_the_root_once_with_log_p_children(size):
    for rank in range(size):
        for child in children(rank, size):
            assert parent(child) == rank
        below = [rank] + [r for c in children(rank, size) for r in [c, *subtree(c, size)]]
        assert sorted(below) == [rank, *subtree(rank, size)]
        assert len(children(rank, size)) <= max(1, math.ceil(math.log2(size)))
    assert list(subtree(0, size)) == list(range(1, size))


def test_reach_routes_around_skipped_ranks():
    # 16 ranks: 0 - {1, 2, 4, 8}, 4 - {5, 6}, 6 - {7}
    assert sorted(reach(4, 16, set())) == [0, 5, 6]
    assert sorted(reach(7, 16, {6})) == [4]
    assert sorted(reach(7, 16, {6, 4})) == [0, 5]
    assert sorted(reach(1, 16, {0})) == [2, 4, 8]


def test_notices_carry_only_what_a_neighbour_lacks():
    spread = Spread(4, 16)
    known = {4: ("ended", 3, True), 5: ("ended", 3, True), 9: ("freed", 1, True)}
    spread.heard(5, [5], final=False)
    first = dict(spread.notices(known, [0, 5, 6]))
    assert first == {0: known, 5: {4: known[4], 9: known[9]}, 6: known}
    assert spread.notices(known, [0, 5, 6]) == []             # told already
    spread.heard(6, [6], final=True)
    known[6] = ("ended", 3, True)
    assert dict(spread.notices(known, [0, 5, 6])) == {0: {6: known[6]}, 5: {6: known[6]}}
    assert unpack(pack(known)) == known
    assert spread.up({0}) is None and spread.up(set()) == 0


def test_a_final_neighbour_is_routed_around_only_where_it_lacks_something():
    spread = Spread(1, 16)                       # rank 1's one neighbour is the root
    known = {0: ("ended", 2, True), 1: ("ended", 2, True)}
    spread.heard(0, [0, 2, 3], final=True)
    spread.told[0].add(1)
    assert spread.around(set(), known) == []
    known[5] = ("ended", 2, True)                # news the root never heard
    assert sorted(spread.around(set(), known)) == [2, 4, 8]


def test_a_final_notice_goes_to_every_neighbour_not_yet_final_lacking_nothing_too():
    spread = Spread(4, 16)
    known = {4: ("ended", 3, True)}
    spread.heard(0, [4], final=False)                     # the parent knows it already
    spread.heard(6, [4], final=True)                      # a child ended
    assert dict(spread.notices(known, [0, 5, 6])) == {5: known}
    assert dict(spread.notices(known, [0, 5, 6], final=True)) == {0: {}, 5: {}}


def test_at_exit_a_rank_whose_program_ends_is_reached_only_as_a_neighbour():
    spread = Spread(1, 16)                       # rank 1's one neighbour is the root
    known = {1: ("ended", 2, True)}
    spread.heard(0, [0], final=True)             # the root ended, lacking rank 1's news
    assert sorted(spread.around(set(), known)) == [2, 4, 8]
    assert sorted(spread.around(set(), known, near_only={2, 4})) == [8]
    neighbours_too = Spread(4, 16)               # 0, 5, 6: kept though their programs end
    assert sorted(neighbours_too.around(set(), known, near_only={0, 5})) == [0, 5, 6]
