"""The ordering twin itself: each kind of race it must catch, what orders work on a GPU (events at
issue time, wait_stream, host syncs), and its vector clocks against plain graph reachability and
adversarial schedules on random programs."""

from __future__ import annotations

import random

import pytest
import torch

from strata_mgpu.stage.device import DeviceContext, DeviceError
from strata_mgpu.stage.streams import (
    InOrderStreams,
    OrderingError,
    OrderingTwin,
    TwinStreams,
    active_twin,
    ordering_twin,
)
from tests.ordering_schedules import build_graph, first_race, replay, run_schedule

CPU = torch.device("cpu")


@pytest.fixture
def ctx() -> DeviceContext:
    return DeviceContext(CPU, twin=OrderingTwin(), name="s")


def test_read_before_its_writer_names_stream_buffer_and_event(ctx):
    buf = ctx.label(torch.zeros(4), "buffer")
    ready = ctx.event("ready")
    with ctx.use(ctx.upload):
        ctx.access(buf, "w")
        ctx.record(ready)
    with ctx.use(ctx.compute):
        message = (r"^s\.compute reads 's buffer' at test_ordering\.py:\d+ .*, but its write on s\.upload at "
                   r"test_ordering\.py:\d+ .* is not ordered before: missing a wait on 's ready' \(recorded on "
                   r"s\.upload after that write\) on s\.compute$")
        with pytest.raises(OrderingError, match=message):
            ctx.access(buf, "r")
        ctx.wait(ready)
        ctx.access(buf[:2], "r")  # a view is its whole storage
    assert ctx.twin.cross_stream == 1 and ctx.twin.accesses == 3


def test_write_over_a_read_still_needed(ctx):
    buf = ctx.label(torch.zeros(4), "buffer")
    free = ctx.event("free")
    with ctx.use(ctx.compute):
        ctx.access(buf, "r")
        ctx.record(free)
    with ctx.use(ctx.upload):
        with pytest.raises(OrderingError, match=r"s\.upload writes 's buffer'.*its read on s\.compute.*missing a wait "
                                                r"on 's free'"):
            ctx.access(buf, "w")
        ctx.wait(free)
        ctx.access(buf, "w")


def test_write_after_write_and_no_event_to_name(ctx):
    with ctx.use(ctx.upload):
        ctx.access("rows", "w")
    with ctx.use(ctx.compute), pytest.raises(OrderingError, match=r"s\.compute writes 'rows'.*its write on s\.upload"
                                                                  r".*none is recorded there"):
        ctx.access("rows", "w")


def test_an_event_orders_only_what_was_queued_before_its_record(ctx):
    e = ctx.event("e")
    with ctx.use(ctx.compute):
        ctx.wait(e)  # never recorded yet: no wait, as on CUDA
    with ctx.use(ctx.upload):
        ctx.access("x", "w")
        ctx.record(e)
        ctx.access("y", "w")  # after the record: not covered by it
    with ctx.use(ctx.compute):
        with pytest.raises(OrderingError, match="reads 'x'"):  # the wait was issued before the record
            ctx.access("x", "r")
        ctx.wait(e)
        ctx.access("x", "r")
        with pytest.raises(OrderingError, match="reads 'y'"):
            ctx.access("y", "r")


def test_on_compute_wait_stream_and_host_sync_order_work(ctx):
    with ctx.use(ctx.upload):
        ctx.access("a", "w")
    ctx.access("b", "w")  # on the caller's stream, s.default
    with ctx.on_compute():  # waits for the caller's stream
        ctx.access("b", "r")
        with pytest.raises(OrderingError, match="s.compute reads 'a'"):
            ctx.access("a", "r")
        ctx.access("c", "w")
    ctx.access("c", "r")  # the caller joined the compute stream
    with ctx.on_compute(after_caller=False, join_caller=False):
        ctx.access("d", "w")
    with pytest.raises(OrderingError, match="s.default reads 'd'"):
        ctx.access("d", "r")
    ctx.synchronize(ctx.upload)  # the host waits for the upload: all work issued later runs after it
    with ctx.use(ctx.compute):
        ctx.access("a", "r")


def test_contexts_get_twin_streams_only_where_asked():
    plain = DeviceContext(CPU)
    assert plain.compute is None and plain.event("x") is None and active_twin() is None
    with plain.use(plain.compute):
        plain.access("anything", "w")  # no-ops
        plain.wait(plain.event())
    with ordering_twin() as twin:
        a, b = DeviceContext(CPU), DeviceContext(CPU)
        assert active_twin() is twin
    assert (a.name, b.name) == ("cpu0", "cpu1") and a.twin is twin and b.compute.name == "cpu1.compute"
    with pytest.raises(DeviceError, match="twin runs on the CPU"):
        DeviceContext(torch.device("cuda", 0), twin=twin)


def _random_program(seed: int, n_accesses: int = 12) -> tuple[OrderingTwin, int | None]:
    """Random accesses of two buffers from three streams of two contexts and the host, most of them
    ordered after the buffer's earlier users (an event recorded there and waited on, a wait_stream
    or a host sync), some not, with stray records and waits between; returns the twin and the
    index of the trace op it raised at (None: no race)."""
    rng = random.Random(seed)
    twin = OrderingTwin(trace=True)
    a, b = TwinStreams(twin, "a"), TwinStreams(twin, "b")
    streams = [a.default, a.new_stream("upload"), b.default]
    events = [twin.event(f"e{i}") for i in range(3)]
    users: dict[str, list] = {"x": [], "y": []}  # buffer -> streams that touched it
    try:
        for _ in range(n_accesses):
            s = twin.host if rng.random() < 0.1 else rng.choice(streams)
            name, mode = rng.choice("xy"), rng.choice("rw")
            for t in set(users[name]) - {s}:
                if rng.random() < 0.1:
                    continue  # the missing wait
                if t is twin.host:
                    continue  # work issued after a host step runs after it
                how = "sync" if s is twin.host else rng.choices(["event", "stream", "sync"], [6, 1, 1])[0]
                if how == "event":
                    e = rng.choice(events)
                    twin.record(e, t)
                    twin.wait(e, s)
                elif how == "stream":
                    twin.wait_stream(s, t)
                else:
                    twin.synchronize(t)
            if rng.random() < 0.3:  # a stray record or wait
                op = twin.record if rng.random() < 0.5 else twin.wait
                op(rng.choice(events), rng.choice(streams))
            twin.access(s, name, mode, "here")
            users[name].append(s)
    except OrderingError:
        return twin, len(twin.trace) - 1
    return twin, None


def _ancestors(nodes, i: int) -> set[int]:
    seen, todo = set(), list(nodes[i].deps)
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            todo.extend(nodes[d].deps)
    return seen


def test_vector_clocks_equal_graph_reachability_on_random_programs():
    """The detector raises exactly at the first access that conflicts with an earlier unordered
    one (plain reachability over the trace's dependency graph). Each race it reports is real: a
    schedule running the racing access before its unordered partner gives some access another
    version of its buffer. Race-free programs keep every version in 20 adversarial schedules."""
    raced = clean = 0
    for seed in range(400):
        twin, raised_at = _random_program(seed)
        race = first_race(twin.trace)
        assert raised_at == (race[0] if race else None), f"program {seed}: twin {raised_at}, graph {race}"
        if race is None:
            clean += 1
            assert replay(twin.trace, range(20)) == 20
            continue
        raced += 1
        nodes = build_graph(twin.trace)
        i = race[0]
        first = sorted(_ancestors(nodes, i) | {i})  # i and what it needs, then everything else
        order = first + [k for k in range(len(nodes)) if k not in set(first)]
        with pytest.raises(OrderingError, match="at version"):
            run_schedule(nodes, order)
    assert raced > 100 and clean > 50  # both verdicts exercised


def test_adversarial_schedules_find_a_missing_wait_that_program_order_hides():
    """The seeded schedules alone, without the clocks: a ring of two slots over four layers, the
    upload stream waiting for readers or not."""
    for wait_free in (True, False):
        twin = OrderingTwin(trace=True)
        home = TwinStreams(twin, "s")
        upload, compute = home.new_stream("upload"), home.new_stream("compute")
        ready = [twin.event(f"ready{k}") for k in range(2)]
        free = [twin.event(f"free{k}") for k in range(2)]
        trace_only = wait_free is False
        for layer in range(4):
            k = layer % 2
            if wait_free:
                twin.wait(free[k], upload)
            _access_unchecked(twin, upload, f"slot{k}", "w", trace_only)
            twin.record(ready[k], upload)
            twin.wait(ready[k], compute)
            _access_unchecked(twin, compute, f"slot{k}", "r", trace_only)
            twin.record(free[k], compute)
        if wait_free:
            assert replay(twin.trace, range(50)) == 50
        else:
            with pytest.raises(OrderingError, match=r"s\.upload writes 'slot0'.*ran before it|reads 'slot0'"):
                replay(twin.trace, range(50), [s.name for s in twin.streams])


def _access_unchecked(twin: OrderingTwin, s, name: str, mode: str, trace_only: bool) -> None:
    if trace_only:  # the trace alone: what the schedules see, with the clocks out of the way
        twin.trace.append(("access", s.index, (name, mode)))
    else:
        twin.access(s, name, mode, "here")


def test_a_cpu_context_waits_for_a_cards_event_on_the_host():
    """Hand-overs between a CPU stage and a card's (`--devices cpu,0`): the card's read or write
    event, waited for on the CPU, is a host wait; the CPU's own events are none."""
    class CardEvent:
        waited = False

        def synchronize(self) -> None:
            self.waited = True

    streams, event = InOrderStreams(), CardEvent()
    streams.wait(None, None)  # the CPU's own (None) events: nothing to wait for
    streams.wait(event, None)
    assert event.waited
