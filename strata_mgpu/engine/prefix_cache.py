"""The prefix cache: an index over the KV pool's blocks, so a conversation's KV is computed once.

A node is one full block of `B` tokens, reached from its parent by the block's tokens (exact keys:
no two prefixes share a node). A node on the device names a pool block and holds one reference to
it; the sequences that computed or continue that prefix hold theirs, so a hit in VRAM copies
nothing: the new sequence's table starts with the same blocks. Blocks are indexed when a prompt
has been computed and when a request ends normally; never from an aborted or failed request,
whose last forward may not have completed.

Tiers: the pool (on the runner's device), then pinned host RAM (`--cache-ram`). When the pool
runs dry it asks the cache (`reclaim`) for blocks only the cache holds, least recently used
first: each moves to the host tier where there is room, else it is dropped; the host tier drops
its least recently used. Both orders are kept in insertion-ordered dicts, touched deepest block
first, so a node is always older than its parent: the oldest is a leaf of its tier and taking it
is O(1). Along any path the device nodes come first, then the host ones.
Everything here runs on the engine's thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from strata_mgpu.engine.runner import KVPool
from strata_mgpu.model.kv_pool import BlockTable, PoolExhausted

DEVICE, HOST = "device", "host"


@dataclass(eq=False)
class Node:
    """Positions [depth B, (depth + 1) B) of every sequence whose prompt starts with the tokens on the path
    from the root to it: in pool block `block` (the device tier), or as `host` cells (the host tier)."""

    tokens: tuple[int, ...]
    parent: Node | None
    depth: int
    block: int | None = None
    host: Any = None
    state: Any = None  # a hybrid model's linear layers' snapshot after this block (the runner's, opaque here)
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)

    @property
    def tier(self) -> str:
        return DEVICE if self.block is not None else HOST


@dataclass
class PrefixMatch:
    """The cached blocks a prompt starts with, as pool blocks (one reference each taken for the new
    sequence's table); the prompt is computed from `n_tokens` on (at least its last token). `copied`:
    blocks brought back from host RAM."""

    blocks: list[int]
    n_tokens: int
    copied: int = 0
    state: Any = None  # a hybrid model's snapshot at n_tokens


@dataclass
class CacheStats:
    """Counters since start (queries, hits, cached tokens given out) and what each tier holds."""

    queries: int = 0
    hits: int = 0
    cached_tokens: int = 0
    saved_blocks: int = 0
    offloaded_blocks: int = 0
    loaded_blocks: int = 0
    dropped_blocks: int = 0
    states: int = 0  # snapshots of a hybrid model's linear state held
    blocks: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0})


class PrefixCache:
    """The index over `pool`'s blocks (see the module docstring); `host_bytes`: the host tier's room.
    `stateful`: a hybrid model's, whose prefix is only usable up to a block that carries its linear
    layers' snapshot (`insert`'s `states`): a match stops at the deepest one."""

    def __init__(self, pool: KVPool, *, host_bytes: int, stateful: bool = False):
        self.stateful = stateful
        self.pool, self.blocks = pool, pool.blocks
        self.block_tokens = self.blocks.block_tokens
        self.host_blocks = max(0, host_bytes // pool.block_bytes) if pool.host_tier else 0
        self.root = Node(tokens=(), parent=None, depth=-1)
        self.stats = CacheStats()
        self._node_of: dict[int, Node] = {}  # pool block -> the node naming it
        self._idle: OrderedDict[Node, None] = OrderedDict()  # device nodes no sequence holds, oldest first
        self._host: OrderedDict[Node, None] = OrderedDict()  # host nodes, oldest first
        self.blocks.reclaim = self.reclaim

    # -- what the scheduler and the engine ask -----------------------------------------------
    @property
    def reclaimable(self) -> int:
        """Pool blocks the cache alone holds: what `reclaim` can give back."""
        return len(self._idle)

    def match(self, prompt: Sequence[int]) -> PrefixMatch | None:
        """The longest chain of cached blocks the prompt starts with, host ones brought back into the pool
        while it has room; one reference of each taken for the caller. None when there is none."""
        self.stats.queries += 1
        path: list[Node] = []
        node, b = self.root, self.block_tokens
        for j in range(len(prompt) // b):
            child = node.children.get(tuple(prompt[j * b:(j + 1) * b]))
            if child is None:
                break
            path.append(child)
            node = child
        n_tokens = min(len(path) * b, len(prompt) - 1)  # its last token is computed: its logits start the answer
        path = path[:-(-n_tokens // b)] if n_tokens > 0 else []
        state = None
        if self.stateful:  # up to the deepest block with a snapshot that ends before the prompt's last token
            deepest = max((j for j, n in enumerate(path) if n.state is not None and (j + 1) * b <= n_tokens),
                          default=-1)
            path = path[:deepest + 1]
            n_tokens = len(path) * b
            state = path[-1].state if path else None
        device = [n for n in path if n.block is not None]  # a prefix of the path (device nodes come first)
        for n in device:  # held now: no reclaim below takes them
            self._idle.pop(n, None)
        self.blocks.ref(n.block for n in device if n.block is not None)
        found = [n.block for n in device if n.block is not None]
        copied = 0
        pending = path[len(device):]
        for n in pending:  # not a victim of the host tier's room that the reclaims below make
            self._host.pop(n, None)
        for n in pending:
            try:
                (block,) = self.blocks.allocate(1)  # the cache's reference
            except PoolExhausted:
                break
            self.pool.load(n.host, block)
            n.host, n.block = None, block
            self._node_of[block] = n
            self.stats.blocks[HOST] -= 1
            self.stats.blocks[DEVICE] += 1
            self.stats.loaded_blocks += 1
            self.blocks.ref([block])  # the caller's
            found.append(block)
            copied += 1
        for n in reversed(pending[copied:]):  # still on the host: back in its order, deepest first
            self._host[n] = None
            self._host.move_to_end(n, last=False)
        if self.stateful and len(found) < len(path):  # the pool ran dry loading: back to a snapshot, or nothing
            found, state = self._stateful_cut(path, found)
        n_tokens = min(n_tokens, len(found) * b)
        self._touch(path[:len(found)])
        if n_tokens <= 0:
            return None
        self.stats.hits += 1
        self.stats.cached_tokens += n_tokens
        return PrefixMatch(found, n_tokens, copied, state)

    def _stateful_cut(self, path: Sequence[Node], found: list[int]) -> tuple[list[int], Any]:
        """The blocks of a stateful match cut to its deepest snapshot within them; the rest's references given
        back (they stay cached)."""
        keep = max((j + 1 for j in range(len(found)) if path[j].state is not None), default=0)
        self.blocks.unref(found[keep:])
        self.released(found[keep:])
        return found[:keep], path[keep - 1].state if keep else None

    def insert(self, table: BlockTable, tokens: Sequence[int], n_rows: int,
               states: Mapping[int, Any] | None = None) -> int:
        """Index the full blocks of a sequence's first `n_rows` rows not indexed yet (the cache takes a
        reference of each); the number indexed. `states`: a hybrid model's snapshots by token count, each
        kept on the node of the block it ends (where that node has none)."""
        b = self.block_tokens
        node, saved = self.root, 0
        path: list[Node] = []
        for j in range(min(n_rows, len(tokens), len(table.ids) * b) // b):
            key, block = tuple(tokens[j * b:(j + 1) * b]), table.ids[j]
            child = node.children.get(key)
            if child is not None and child.block is not None and child.block != block:
                # another copy of this block (two sequences computed it before either was indexed). Held by
                # a sequence, it stays and indexing stops here: the table's later blocks would hang from a
                # block the table does not hold. The cache's alone, the table's copy takes its place.
                if self.blocks.refs[child.block] > 1:
                    break
                self._idle.pop(child, None)
                self._release_block(child)
                self._hold(child, block)
            if child is None:
                child = Node(tokens=key, parent=node, depth=j, block=block)
                node.children[key] = child
                self._hold(child, block)
                self.stats.saved_blocks += 1
                saved += 1
            elif child.block is None:  # on the host: the sequence's copy takes its place in the pool
                self._host.pop(child, None)
                child.host = None
                self.stats.blocks[HOST] -= 1
                self._hold(child, block)
            if states and child.state is None and (j + 1) * b in states:
                child.state = states[(j + 1) * b]
                self.stats.states += 1
            path.append(child)
            node = child
        self._touch(path)
        return saved

    def released(self, blocks: Sequence[int]) -> None:
        """A sequence gave its blocks back: those the cache alone holds now become reclaimable, the most
        recently used (deepest last in the table, so touched first)."""
        for block in reversed(blocks):
            node = self._node_of.get(block)
            if node is not None and self.blocks.refs[block] == 1:
                self._idle[node] = None
                self._idle.move_to_end(node)

    def reclaim(self, n: int) -> int:
        """Give up to n pool blocks back (the pool's hook): idle device blocks, oldest first, each to the host
        tier where it has room (its oldest dropped for it), else dropped. The number given back. An idle
        block with a child still on the device stays (a running sequence may continue the chain with
        blocks of its own, computed before this one was indexed): one pass, never a loop."""
        freed, kept = 0, []
        while freed < n and self._idle:
            node = next(iter(self._idle))
            if any(c.block is not None for c in node.children.values()):
                self._idle.pop(node)
                kept.append(node)
                continue
            self._evict(node)
            freed += 1
        for node in reversed(kept):  # back where they were, the oldest
            self._idle[node] = None
            self._idle.move_to_end(node, last=False)
        return freed

    def clear(self) -> int:
        """Drop every block no sequence holds; the number dropped."""
        before = self.stats.dropped_blocks
        for node in sorted(self._walk(), key=lambda x: -x.depth):
            if not node.children and (node.block is None or self.blocks.refs[node.block] == 1):
                self._drop(node)
        return self.stats.dropped_blocks - before

    def tier_bytes(self) -> dict[str, int]:
        return {tier: n * self.pool.block_bytes for tier, n in self.stats.blocks.items()}

    # -- inside --------------------------------------------------------------------------------
    def _hold(self, node: Node, block: int) -> None:
        self.blocks.ref([block])
        node.block = block
        self._node_of[block] = node
        self.stats.blocks[DEVICE] += 1

    def _touch(self, path: Sequence[Node]) -> None:
        """Most recent now, deepest first: each node stays older than its parent."""
        for node in reversed(path):
            for order in (self._idle, self._host):
                if node in order:
                    order.move_to_end(node)

    def _evict(self, node: Node) -> None:
        """An idle device node out of the pool: to the host tier, or dropped."""
        assert node.block is not None and self.blocks.refs[node.block] == 1
        if self.host_blocks and self._room_on_host(keep=node):
            host = self.pool.offload(node.block)
            self._idle.pop(node)
            self._release_block(node)
            node.host = host
            self._host[node] = None  # after its children, offloaded before it
            self.stats.blocks[HOST] += 1
            self.stats.offloaded_blocks += 1
        else:
            self._drop(node)

    def _room_on_host(self, keep: Node) -> bool:
        while self.stats.blocks[HOST] >= self.host_blocks:
            victim = next((v for v in self._host if not v.children), None)
            if victim is None:
                return False
            self._drop(victim)
        return True

    def _release_block(self, node: Node) -> None:
        assert node.block is not None
        del self._node_of[node.block]
        self.blocks.unref([node.block])
        node.block = None
        self.stats.blocks[DEVICE] -= 1

    def _drop(self, node: Node) -> None:
        """Forget a node and everything below it (unreachable without it)."""
        for child in list(node.children.values()):
            self._drop(child)
        if node.children or node.parent is None:
            return
        if node.block is not None:
            if self.blocks.refs[node.block] > 1:  # a sequence holds it: it stays indexed
                return
            self._idle.pop(node, None)
            self._release_block(node)
        elif node.host is not None:
            self._host.pop(node, None)
            node.host = None
            self.stats.blocks[HOST] -= 1
        if node.state is not None:
            node.state = None
            self.stats.states -= 1
        del node.parent.children[node.tokens]
        node.parent = None
        self.stats.dropped_blocks += 1

    def _walk(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
