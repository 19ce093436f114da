"""A twin's trace as the GPU would see it: the dependency graph of its operations, replayed in
seeded adversarial schedules with a version count per buffer, and its first race found by plain
graph reachability. Both are oracles for the vector clocks of `streams.OrderingTwin`.

The graph: one node per traced operation; a node depends on the previous node of its stream
(program order), on the latest host node issued before it (work issued after a host sync runs
after it), a wait on the event's latest record issued before it, a `wait_stream` on the source
stream's last node before it, and a sync (a host node) on the synced stream's last node. Any
order of the nodes that respects these edges is a schedule some GPU may run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from strata_mgpu.stage.streams import OrderingError

HOST = 0  # the host's stream index in a twin


@dataclass
class Node:
    stream: int
    deps: list[int]
    access: tuple[str, str] | None  # (buffer name, 'r' | 'w') for declared accesses


def build_graph(trace: list[tuple]) -> list[Node]:
    nodes: list[Node] = []
    last_on: dict[int, int] = {}  # stream -> its latest node
    last_record: dict[int, int] = {}  # event -> its latest record node
    for kind, s, arg in trace:
        stream = HOST if kind == "sync" else s
        deps = [d for d in (last_on.get(stream), last_on.get(HOST)) if d is not None]
        if kind == "wait" and arg in last_record:
            deps.append(last_record[arg])
        elif kind == "wait_stream" and arg in last_on:
            deps.append(last_on[arg])
        elif kind == "sync" and s in last_on:
            deps.append(last_on[s])
        i = len(nodes)
        if kind == "record":
            last_record[arg] = i
        nodes.append(Node(stream, sorted(set(deps)), arg if kind == "access" else None))
        last_on[stream] = i
    return nodes


def first_race(trace: list[tuple]) -> tuple[int, int] | None:
    """(later, earlier): the first traced access that conflicts with an earlier one on another
    stream not among its ancestors; None when every conflicting pair is ordered."""
    nodes = build_graph(trace)
    ancestors: list[int] = []  # bit j of ancestors[i]: node j happens before node i
    seen: dict[str, list[int]] = {}  # buffer -> its access nodes so far
    for i, node in enumerate(nodes):
        a = 0
        for d in node.deps:
            a |= ancestors[d] | (1 << d)
        ancestors.append(a)
        if node.access is None:
            continue
        name, mode = node.access
        for j in seen.get(name, []):
            other = nodes[j]
            if other.stream != node.stream and "w" in (mode, other.access[1]) and not (a >> j) & 1:
                return i, j
        seen.setdefault(name, []).append(i)
    return None


def _program_versions(nodes: list[Node]) -> list[int | None]:
    """The version of its buffer each access sees when everything runs in issue order."""
    version: dict[str, int] = {}
    seen = []
    for node in nodes:
        if node.access is None:
            seen.append(None)
            continue
        name, mode = node.access
        seen.append(version.get(name, 0))
        if mode == "w":
            version[name] = version.get(name, 0) + 1
    return seen


def run_schedule(nodes: list[Node], order: list[int], label=str, what: str = "schedule") -> None:
    """Run the nodes in `order` (it must respect their dependencies) with a version count per
    buffer; raise OrderingError when an access sees another version of its buffer than in issue
    order (a read before its writer, or a write over a read still to come)."""
    want = _program_versions(nodes)
    done = [False] * len(nodes)
    version: dict[str, int] = {}
    writer: dict[str, int] = {}
    for i in order:
        node = nodes[i]
        assert all(done[d] for d in node.deps), f"{what}: node {i} runs before its dependencies"
        done[i] = True
        if node.access is None:
            continue
        name, mode = node.access
        got = version.get(name, 0)
        if got != want[i]:
            by = writer.get(name)
            cause = (f"the write on {label(nodes[by].stream)} (op {by}) ran before it" if got > want[i]
                     else "its writer has not run")
            raise OrderingError(f"{what}: {label(node.stream)} {'reads' if mode == 'r' else 'writes'} {name!r} "
                                f"(op {i}) at version {got}, in issue order {want[i]}: {cause}")
        if mode == "w":
            version[name] = got + 1
            writer[name] = i


def adversarial_order(nodes: list[Node], seed: int) -> list[int]:
    """A schedule that runs the ready streams by a random priority, redrawn now and then, so a
    favoured stream runs as far ahead as its waits let it."""
    rng = random.Random(seed)
    queues: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        queues.setdefault(node.stream, []).append(i)
    done = [False] * len(nodes)
    heads = dict.fromkeys(queues, 0)
    priority = list(queues)
    rng.shuffle(priority)
    order = []
    for _ in range(len(nodes)):  # issue order is a schedule, so some stream's next node is always ready
        if rng.random() < 0.1:
            rng.shuffle(priority)
        s = next(s for s in priority if heads[s] < len(queues[s])
                 and all(done[d] for d in nodes[queues[s][heads[s]]].deps))
        i = queues[s][heads[s]]
        heads[s] += 1
        done[i] = True
        order.append(i)
    return order


def replay(trace: list[tuple], seeds, stream_names: list[str] | None = None) -> int:
    """Run the trace in one adversarial schedule per seed (`run_schedule`); returns how many ran."""
    nodes = build_graph(trace)
    names = stream_names or []
    label = lambda s: names[s] if s < len(names) else f"stream {s}"  # noqa: E731
    runs = 0
    for seed in seeds:
        run_schedule(nodes, adversarial_order(nodes, seed), label, f"schedule {seed}")
        runs += 1
    return runs
