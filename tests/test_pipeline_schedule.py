"""Schedule simulator: every op once, dependency order, bubble, static stash bound, errors."""
import itertools

import pytest

from jaxtrain.ledger.pipeline_schedule import (ScheduleError, build_schedule, rank_orders, simulate)


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
    """Run the table's slot bookkeeping in Python, B before F in a step (the executor's order);
    every read must find the value it expects. Returns each rank's peak of stash slots in use
    (what an F saved and its B has not read yet) and of inbox slots."""
    cols, num_v = table.columns, p * v
    inbox, stash, grads = ([dict() for _ in range(p)] for _ in range(3))
    in_flight_x, in_flight_g = {}, {}   # rank -> value arriving at the start of the next step
    peak, peak_in = [0] * p, [0] * p
    col = lambda name, t, r: int(cols[name][t, r])  # noqa: E731
    for t in range(table.num_steps):
        for r in range(p):
            for name, box, flight in (("recv_x", inbox, in_flight_x), ("recv_g", grads,
                                                                        in_flight_g)):
                slot = col(name, t, r)
                if slot >= 0:
                    assert slot not in box[r], f"{name} slot overwritten while in use"
                    box[r][slot] = flight[r]
            peak_in[r] = max(peak_in[r], len(inbox[r]))
        sends_x, sends_g = {}, {}
        for r in range(p):
            j, k = col("b_chunk", t, r), col("b_mb", t, r)
            if j >= 0:
                g = j * p + r
                if g == num_v - 1:   # its F is folded in: reads its input from the inbox
                    assert col("b_res", t, r) < 0 and col("b_gslot", t, r) < 0
                    if g > 0:
                        assert inbox[r].pop(col("b_in", t, r)) == (g, k)
                else:
                    assert stash[r].pop(col("b_res", t, r)) == (g, k)
                    assert grads[r].pop(col("b_gslot", t, r)) == (g, k)
                if g > 0:
                    sends_g[(r - 1) % p] = (g - 1, k)
            j, k = col("f_chunk", t, r), col("f_mb", t, r)
            if j >= 0:
                g = j * p + r
                assert not (backward and g == num_v - 1), "the last stage's F is in its B"
                assert (col("f_in", t, r) < 0) == (g == 0)
                if g > 0:
                    assert inbox[r].pop(col("f_in", t, r)) == (g, k)
                if backward:
                    slot = col("f_res", t, r)
                    assert slot >= 0 and slot not in stash[r], "stash slot in use"
                    stash[r][slot] = (g, k)
                else:
                    assert col("f_res", t, r) < 0
                if g < num_v - 1:
                    sends_x[(r + 1) % p] = (g + 1, k)
            peak[r] = max(peak[r], len(stash[r]))
        in_flight_x, in_flight_g = sends_x, sends_g
    assert not any(inbox) and not any(stash) and not any(grads)
    return tuple(peak), tuple(peak_in)


@pytest.mark.parametrize("kind,p,m,v", [c for c in CASES if c[1] in (2, 4)])
def test_table_slots_hold_the_right_values(kind, p, m, v):
    s = build_schedule(kind, p, m, v)
    assert _replay(s.table, p, m, v, backward=True) == (s.stash_slots, s.table.inbox_slots)
    fwd = s.forward_table
    assert _replay(fwd, p, m, v, backward=False) == ((0,) * p, fwd.inbox_slots)
    assert all(n <= 1 for n in fwd.inbox_slots)


@pytest.mark.parametrize("kind,p,v", [("1f1b", 2, 1), ("1f1b", 4, 1), ("1f1b", 8, 1),
                                      ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 4, 2),
                                      ("interleaved_1f1b", 4, 4)])
def test_1f1b_stash_does_not_grow_with_microbatches(kind, p, v):
    bounds = [build_schedule(kind, p, m, v).stash_slots for m in (2 * p, 8 * p, 32)]
    assert bounds[0] == bounds[1] == bounds[2]
    if v == 1:   # rank r's first B comes 2(p-1-r) steps after its first F (one step per hop
        # there and back); the last stage's F is folded into its B and stashes nothing
        assert bounds[0] == tuple(2 * (p - 1 - r) for r in range(p))
    else:        # Megatron's interleaved warm-up: 2(p-1-r) + (v-1)p forwards before a B
        assert bounds[0] == tuple(2 * (p - 1 - r) + (v - 1) * p for r in range(p))


def test_gpipe_stash_grows_with_microbatches():
    assert build_schedule("gpipe", 4, 8).stash_slots == (8, 8, 8, 0)
    assert build_schedule("gpipe", 4, 32).stash_slots == (32, 32, 32, 0)


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
