"""The resharding refit's plan by hand (megak3/posttrain/refit.py plan_pieces): pieces are the intersections
of each engine box with the trainer's distinct boxes, taken locally when the engine rank holds them, and
every trainer byte leaves its owner once per replica."""
import pytest

from megak3.posttrain.refit import plan_pieces

F = "torch.float32"


def _box(g, off, shp):
    return (g, off, shp, F)


def test_row_split_trainer_into_two_whole_tensor_replicas():
    # trainer tp2 splits w [4, 2] by rows; each of two tp1 engine replicas (ranks 0 and 1) holds all of it
    src = [{"w": _box((4, 2), (0, 0), (2, 2))}, {"w": _box((4, 2), (2, 0), (2, 2))}]
    dst = [{"w": _box((4, 2), (0, 0), (4, 2))}, {"w": _box((4, 2), (0, 0), (4, 2))}]
    pairs = plan_pieces(src, dst, [0, 1])
    assert pairs == {(0, 0): [("w", ((0, 0), (2, 2)))], (1, 0): [("w", ((2, 0), (2, 2)))],
                     (0, 1): [("w", ((0, 0), (2, 2)))], (1, 1): [("w", ((2, 0), (2, 2)))]}
    for s in (0, 1):  # each trainer shard leaves its owner once for the other replica (and is copied locally once)
        sent = [p for (a, d), ps in pairs.items() if a == s and d != s for p in ps]
        assert len(sent) == 1


def test_row_split_into_column_split_cuts_four_pieces():
    # trainer: rows [0, 2) / [2, 4) on ranks 0, 1; engine (one tp2 replica on ranks 0, 1): columns [0, 1) / [1, 2)
    src = [{"w": _box((4, 2), (0, 0), (2, 2))}, {"w": _box((4, 2), (2, 0), (2, 2))}]
    dst = [{"w": _box((4, 2), (0, 0), (4, 1))}, {"w": _box((4, 2), (0, 1), (4, 1))}]
    pairs = plan_pieces(src, dst, [0, 0])
    assert pairs[(0, 0)] == [("w", ((0, 0), (2, 1)))] and pairs[(1, 0)] == [("w", ((2, 0), (2, 1)))]
    assert pairs[(0, 1)] == [("w", ((0, 1), (2, 1)))] and pairs[(1, 1)] == [("w", ((2, 1), (2, 1)))]


def test_data_parallel_copies_take_turns_and_gaps_are_errors():
    # a replicated tensor on 2 data-parallel trainer ranks; a tp2 engine replica on ranks 2, 3 replicates it too:
    # each engine rank takes it from a different trainer copy
    whole = _box((3,), (0,), (3,))
    pairs = plan_pieces([{"b": whole}, {"b": whole}, None, None], [None, None, {"b": whole}, {"b": whole}],
                        [None, None, 0, 0])
    assert sorted(pairs) == [(0, 2), (1, 3)]
    with pytest.raises(ValueError, match="cover 2 of the 3 elements"):
        plan_pieces([{"b": _box((3,), (0,), (2,))}], [{"b": whole}], [0])
