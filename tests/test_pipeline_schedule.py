"""Schedule simulator: every op once, dependency order, bubble, static stash bound, errors."""
import itertools

import pytest

from jaxtrain.pipeline_schedule import (ScheduleError, build_schedule, rank_orders, simulate)


def _cases():
    for p, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 4, 6, 8, 16)):
        yield "gpipe", p, m, 1
        yield "1f1b", p, m, 1
        for v in (1, 2, 3):
            if v == 1 or m % p == 0:
                yield "interleaved_1f1b", p, m, v


CASES = list(_cases())


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_each_op_once_in_dependency_order(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    num_v = p * v
    at = {}
    for t, row in enumerate(s.steps):
        assert len(row) == p
        for r, ops in enumerate(row):
            assert sum(o.kind == "F" for o in ops) <= 1 and sum(o.kind == "B" for o in ops) <= 1
            assert [o.kind for o in ops] in ([], ["F"], ["B"], ["F", "B"])   # F before B
            for o in ops:
                assert o.vstage % p == r, "virtual stage g must run on rank g % p"
                key = (o.kind, o.vstage, o.microbatch)
                assert key not in at, f"{key} scheduled twice"
                at[key] = t
    assert set(at) == {(k, g, mb) for k in "FB" for g in range(num_v) for mb in range(m)}
    for g, mb in itertools.product(range(num_v), range(m)):
        if g > 0:   # activations cross ranks: one step of latency
            assert at[("F", g - 1, mb)] < at[("F", g, mb)]
        if g < num_v - 1:
            assert at[("B", g + 1, mb)] < at[("B", g, mb)]
            assert at[("F", g, mb)] < at[("B", g, mb)]
        else:       # the last virtual stage may run F and B of a microbatch in one step
            assert at[("F", g, mb)] <= at[("B", g, mb)]


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_bubble_is_megatrons_and_stays_when_b_costs_2f(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    ideal = (p - 1) / (m * v)
    assert s.bubble() == pytest.approx(ideal, abs=1e-12)
    assert s.bubble(fwd_cost=1, bwd_cost=2) == pytest.approx(ideal, abs=1e-12)


def _replay(table, p, m, v, backward):
    """Run the table's slot bookkeeping in Python; every read must find the value it expects."""
    cols, num_v = table.columns, p * v
    stash = [dict() for _ in range(p)]
    grads = [dict() for _ in range(p)]
    in_flight_x = {}   # rank -> value arriving at the start of the next step
    in_flight_g = {}
    peak = [0] * p
    for t in range(table.num_steps):
        for r in range(p):
            slot = cols["recv_x"][t, r]
            if slot >= 0:
                assert slot not in stash[r], "stash slot overwritten while in use"
                stash[r][slot] = in_flight_x[r]
            slot = cols["recv_g"][t, r]
            if slot >= 0:
                assert slot not in grads[r], "cotangent slot overwritten while in use"
                grads[r][slot] = in_flight_g[r]
            peak[r] = max(peak[r], len(stash[r]))
        sends_x, sends_g = {}, {}
        for r in range(p):
            j, k, slot = cols["f_chunk"][t, r], cols["f_mb"][t, r], cols["f_slot"][t, r]
            if j >= 0:
                g = j * p + r
                assert (slot < 0) == (g == 0)
                if g > 0:
                    assert stash[r][slot] == (g, k)
                    if not backward:
                        del stash[r][slot]
                if g < num_v - 1:
                    sends_x[(r + 1) % p] = (g + 1, k)
            j, k = cols["b_chunk"][t, r], cols["b_mb"][t, r]
            if j >= 0:
                g = j * p + r
                slot, gslot = cols["b_slot"][t, r], cols["b_gslot"][t, r]
                if g > 0:
                    assert stash[r].pop(slot) == (g, k)
                if g < num_v - 1:
                    assert grads[r].pop(gslot) == (g, k)
                else:
                    assert gslot < 0
                if g > 0:
                    sends_g[(r - 1) % p] = (g - 1, k)
        in_flight_x, in_flight_g = sends_x, sends_g
    assert all(not s for s in stash) and all(not g for g in grads)
    return tuple(peak)


@pytest.mark.parametrize("kind,p,m,v", [c for c in CASES if c[1] in (2, 4)])
def test_table_slots_hold_the_right_values(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    assert _replay(s.table, p, m, v, backward=True) == s.stash_slots
    assert _replay(s.forward_table, p, m, v, backward=False) == s.forward_table.stash_slots
    assert all(n <= 1 for n in s.forward_table.stash_slots)


@pytest.mark.parametrize("kind,p,v", [("1f1b", 2, 1), ("1f1b", 4, 1), ("1f1b", 8, 1),
                                      ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 4, 2),
                                      ("interleaved_1f1b", 4, 4)])
def test_1f1b_stash_does_not_grow_with_microbatches(kind, p, v):
    bounds = [build_schedule(kind, p, m, v).stash_slots for m in (2 * p, 8 * p, 32)]
    assert bounds[0] == bounds[1] == bounds[2]
    if v == 1:   # rank 0 reads x; a round trip to the last rank and back takes 2(p-1-r)+1 steps
        assert bounds[0] == (0,) + tuple(2 * (p - 1 - r) + 1 for r in range(1, p))


def test_gpipe_stash_grows_with_microbatches():
    assert build_schedule("gpipe", 4, 8).stash_slots == (0, 8, 8, 8)
    assert build_schedule("gpipe", 4, 32).stash_slots == (0, 32, 32, 32)


def test_num_steps():
    assert build_schedule("gpipe", 4, 8).num_steps == 2 * (8 + 4 - 1) - 1
    assert build_schedule("1f1b", 4, 8).num_steps == 8 + 2 * (4 - 1)
    assert build_schedule("1f1b", 4, 8).forward_table.num_steps == 8 + 4 - 1


@pytest.mark.parametrize("args,match", [
    (("zero_bubble", 4, 8, 1), "unknown pipeline schedule"),
    (("1f1b", 4, 8, 2), "needs schedule='interleaved_1f1b'"),
    (("gpipe", 2, 4, 2), "needs schedule='interleaved_1f1b'"),
    (("interleaved_1f1b", 4, 6, 2), "microbatches divisible by stages"),
    (("1f1b", 0, 8, 1), "stages=0"),
    (("1f1b", 4, 0, 1), "microbatches=0"),
    (("interleaved_1f1b", 4, 8, 0), "virtual_stages=0"),
    (("1f1b", 4, 2.0, 1), "microbatches=2.0"),
])
def test_bad_schedules_raise_clear_errors(args, match):
    with pytest.raises(ScheduleError, match=match):
        build_schedule(*args)
    assert issubclass(ScheduleError, ValueError)


def test_deadlocking_order_is_reported():
    orders = rank_orders("1f1b", 2, 2, 1)
    orders[0] = [o for o in orders[0] if o.kind == "B"] + [o for o in orders[0] if o.kind == "F"]
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(orders, 2, 1)
