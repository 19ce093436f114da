"""The prefix cache: a conversation's KV computed once.

Full blocks of `B` tokens stay, keyed by their token prefix: a tree whose node is one block,
reached from its parent by the block's tokens (exact keys: no two prefixes share a node). A new
request takes the longest matching chain and computes only the rest. Blocks are saved when a
prompt has been computed and when a request ends normally; never from an aborted or failed
request, whose last forward may not have completed.

Tiers: the runner's device (counted against its KV budget; the least recently used move out when
admission needs the room), then pinned host RAM (`--cache-ram`); past that the least recently
used are dropped, leaves first. A matched request pins its blocks until they are copied in.
Everything here runs on the engine's thread. Sequences whose KV spills are not saved.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from strata_mgpu.engine.runner import KVBlocks, SequenceState

DEVICE, HOST = "device", "host"


@dataclass(eq=False)
class Block:
    """One cached block: positions [depth B, (depth + 1) B) of every sequence whose prompt starts
    with the tokens on the path from the root to it."""

    tokens: tuple[int, ...]
    parent: Block | None
    depth: int  # its index in the sequence
    data: Any = None  # the runner's block (KVBlocks), None at the root
    tier: str = DEVICE
    last_used: int = 0
    pins: int = 0
    children: dict[tuple[int, ...], Block] = field(default_factory=dict)


@dataclass
class PrefixMatch:
    """The blocks a request's prompt starts with, pinned until `restore` or `release`; the request
    computes its prompt from `n_tokens` on (at least its last token)."""

    blocks: list[Block]
    n_tokens: int
    pinned: bool = True


@dataclass
class CacheStats:
    """Counters since start (queries, hits, cached tokens given out) and what each tier holds."""

    queries: int = 0
    hits: int = 0
    cached_tokens: int = 0
    saved_blocks: int = 0
    offloaded_blocks: int = 0
    dropped_blocks: int = 0
    blocks: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0})


class PrefixCache:
    """Blocks of `store.block_tokens` tokens of a runner's sequences (see the module docstring)."""

    def __init__(self, store: KVBlocks[Any], *, host_bytes: int):
        self.store = store
        self.block_tokens = store.block_tokens
        self.host_blocks = max(0, host_bytes // store.block_bytes)  # the host tier's (or only tier's) room
        self.root = Block(tokens=(), parent=None, depth=-1)
        self.stats = CacheStats()
        self._clock = itertools.count(1)

    # -- what the scheduler and the engine ask -----------------------------------------------
    @property
    def device_cells(self) -> int:
        """KV cells the device tier takes (they count against the runner's KV budget)."""
        return self.stats.blocks[DEVICE] * self.block_tokens if self.store.host_tier else 0

    def match(self, prompt: Sequence[int]) -> PrefixMatch | None:
        """The longest chain of cached blocks the prompt starts with, pinned; None when there is none."""
        self.stats.queries += 1
        blocks: list[Block] = []
        node, b = self.root, self.block_tokens
        for j in range(len(prompt) // b):
            child = node.children.get(tuple(prompt[j * b:(j + 1) * b]))
            if child is None:
                break
            blocks.append(child)
            node = child
        n_tokens = min(len(blocks) * b, len(prompt) - 1)  # its last token is computed: its logits start the answer
        if n_tokens <= 0:
            return None
        blocks = blocks[:-(-n_tokens // b)]
        for block in blocks:
            block.pins += 1
        self._touch(blocks)
        self.stats.hits += 1
        self.stats.cached_tokens += n_tokens
        return PrefixMatch(blocks, n_tokens)

    def restore(self, kv: SequenceState, found: PrefixMatch) -> None:
        """Copy the matched blocks into the request's fresh cache (queued on the runner's streams), then
        unpin them."""
        try:
            self.store.load(kv, [block.data for block in found.blocks], found.n_tokens)
        finally:
            self.release(found)

    def release(self, found: PrefixMatch) -> None:
        if found.pinned:
            found.pinned = False
            for block in found.blocks:
                block.pins -= 1

    def insert(self, kv: SequenceState, tokens: Sequence[int], n_rows: int) -> int:
        """Save the full blocks of the sequence's first `n_rows` rows not cached yet; the number saved."""
        if not self.store.cacheable(kv):
            return 0
        b = self.block_tokens
        node, saved = self.root, 0
        path: list[Block] = []
        for j in range(min(n_rows, len(tokens)) // b):
            key = tuple(tokens[j * b:(j + 1) * b])
            child = node.children.get(key)
            if child is None:
                if not self.store.host_tier and not self._room_on_host(1, keep=path):
                    break
                child = Block(tokens=key, parent=node, depth=j, data=self.store.save(kv, j))
                node.children[key] = child
                self.stats.blocks[DEVICE] += 1
                self.stats.saved_blocks += 1
                saved += 1
            path.append(child)
            node = child
        self._touch(path)
        return saved

    def shrink_device(self, max_cells: int) -> None:
        """Move device blocks out (least recently used first) until the tier takes at most `max_cells`."""
        if not self.store.host_tier or self.device_cells <= max(0, max_cells):
            return
        for block in self._oldest(DEVICE):
            if self.device_cells <= max(0, max_cells):
                return
            if block.parent is None:  # dropped with an ancestor before it
                continue
            if self._room_on_host(1, keep=[block]):
                block.data = self.store.offload(block.data)
                block.tier = HOST
                self.stats.blocks[DEVICE] -= 1
                self.stats.blocks[HOST] += 1
                self.stats.offloaded_blocks += 1
            else:
                self._drop(block)

    def clear(self) -> int:
        """Drop every block not pinned; the number dropped."""
        before = self.stats.dropped_blocks
        for block in list(self.root.children.values()):
            self._drop(block)
        return self.stats.dropped_blocks - before

    def tier_bytes(self) -> dict[str, int]:
        return {tier: n * self.store.block_bytes for tier, n in self.stats.blocks.items()}

    # -- inside --------------------------------------------------------------------------------
    def _touch(self, path: list[Block]) -> None:
        t = next(self._clock)
        for block in path:  # one time for the whole path; ties go deepest first (`_oldest`)
            block.last_used = t

    def _walk(self) -> Iterator[Block]:
        stack = list(self.root.children.values())
        while stack:
            block = stack.pop()
            yield block
            stack.extend(block.children.values())

    def _oldest(self, tier: str) -> list[Block]:
        return sorted((b for b in self._walk() if b.tier == tier and not b.pins),
                      key=lambda b: (b.last_used, -b.depth))

    def _room_on_host(self, n: int, keep: Sequence[Block] = ()) -> bool:
        """Drop least recently used host blocks (never `keep` or its ancestors) for n more; whether there is room."""
        tier = HOST if self.store.host_tier else DEVICE
        if self.stats.blocks[tier] + n <= self.host_blocks:
            return True
        protected = {id(a) for b in keep for a in _chain(b)}
        for victim in self._oldest(tier):
            if victim.parent is None or id(victim) in protected:
                continue  # None: dropped already, with an ancestor dropped before it
            self._drop(victim)
            if self.stats.blocks[tier] + n <= self.host_blocks:
                return True
        return False

    def _drop(self, block: Block) -> None:
        """Forget a block and everything below it (unreachable without it); pinned blocks and their
        ancestors stay."""
        for child in list(block.children.values()):
            self._drop(child)
        if block.pins or block.children:
            return
        assert block.parent is not None
        del block.parent.children[block.tokens]
        self.stats.blocks[block.tier] -= 1
        self.stats.dropped_blocks += 1
        block.data, block.parent = None, None


def _chain(block: Block) -> Iterator[Block]:
    node: Block | None = block
    while node is not None and node.parent is not None:
        yield node
        node = node.parent
