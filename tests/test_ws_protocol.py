"""The synchronisation protocol of the warp-specialised Gluon GEMMs (moeflow/kernels/moe_gemm_ws.py),
model-checked on the CPU.

The kernels cannot run here, and a wrong phase or a missing arrival costs a hung GPU call. So this
replays their protocol, step for step as the kernels issue it, against a model of the hardware's
mbarriers (arrival counts, transaction bytes, parity waits that pass when the barrier's completed-phase
count has the other parity) under thousands of random interleavings of the producer, the two consumers
and the asynchronous copies, and asserts:
  - no deadlock: every agent finishes;
  - a consumer's wgmma reads a ring stage only when it holds this position's complete data (the TMA
    boxes landed; for gate_up, the row copies are complete and were handed over);
  - nothing overwrites a stage while a wgmma may still read it.
It also shows why the ordering barrier is there: without it the protocol breaks (a parity wait of
consumer 1 at kernel start passes on a fresh barrier).
"""

from __future__ import annotations

import random

import pytest


class Barrier:
    """An mbarrier: `count` arrivals and the expected transaction bytes complete a phase."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phases = count, count, 0, 0

    def arrive(self):
        assert self.pending > 0, "arrival on a barrier with no pending arrivals"
        self.pending -= 1
        self._maybe_complete()

    def expect(self, nbytes: int):  # mbarrier.expect: arrive.expect_tx
        self.tx += nbytes
        self.arrive()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        assert self.tx >= 0
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phases += 1
            self.pending = self.count

    def passes(self, parity: int) -> bool:  # try_wait.parity
        return (self.phases & 1) != parity


class Sim:
    """Agents are generators yielding ('wait', barrier, parity) or None (one step); async copies are
    pending events the scheduler completes at random times."""

    def __init__(self, stages: int, seed: int):
        self.rng = random.Random(seed)
        self.stages = stages
        self.data = [None] * stages  # position whose data a stage holds (None: being written / stale)
        self.landed = [set() for _ in range(stages)]  # parts of that position's data that landed
        self.reading: dict[int, set] = {s: set() for s in range(stages)}  # in-flight wgmma reads
        self.events: list = []  # async completions: callables

    def run(self, agents: dict, max_steps: int = 200000):
        live = dict(agents)
        waiting: dict = {}
        for _ in range(max_steps):
            runnable = [n for n in live if n not in waiting or waiting[n][0].passes(waiting[n][1])]
            choices = runnable + (["event"] if self.events else [])
            if not choices:
                raise AssertionError(f"deadlock: {sorted(live)} wait, no copy in flight")
            pick = self.rng.choice(choices)
            if pick == "event":
                self.events.pop(self.rng.randrange(len(self.events)))()
                continue
            waiting.pop(pick, None)
            try:
                op = next(live[pick])
            except StopIteration:
                del live[pick]
                if not live and not self.events:
                    return
                continue
            if op is not None and op[0] == "wait":
                waiting[pick] = (op[1], op[2])
        raise AssertionError("no progress bound reached")

    # data movement
    def fill(self, s: int, pos: int, part: str, bar: Barrier | None, nbytes: int):
        """An async copy of `part` of position pos into stage s, completing a barrier's tx (TMA) or not."""
        assert not self.reading[s], f"stage {s} overwritten (position {pos}) while a wgmma reads it"
        if self.data[s] != pos:
            self.data[s], self.landed[s] = pos, set()

        def done():
            self.landed[s].add(part)
            if bar is not None:
                bar.complete_tx(nbytes)

        self.events.append(done)

    def read(self, s: int, pos: int, parts: set, who: str):
        assert self.data[s] == pos and parts <= self.landed[s], (
            f"{who} reads stage {s} for position {pos} but it holds {self.data[s]} with {self.landed[s]}")
        self.reading[s].add(who)


def tile_ids(tile, num_m, num_n, group_m):
    in_group = group_m * num_n
    first_m = (tile // in_group) * group_m
    size_m = min(num_m - first_m, group_m)
    return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m


def run_protocol(n_tiles_total, k_tiles, stages, nprogs, pid, seed, gate_up: bool, order: bool = True,
                 copy_depth: int = 2, coop: bool = False, skip_waits: bool = True):
    """One CTA (program pid of nprogs) of moe_down_ws_kernel (gate_up=False) or moe_gate_up_ws_kernel.
    Some tiles (chosen by the seed) are all padding: every agent skips them (moe_gemm_ws._ws_live).
    coop: the cooperative schedule (both consumers read every live tile's stages, 64 rows each; the
    empty barriers count 2; consumer 1 skips the wgmmas of tiles whose second half is padding, chosen by
    the seed, but waits for each stage (skip_waits; False: the mutation without those waits) and frees it:
    moe_gemm_ws._ws_skip_tile)."""
    sim = Sim(stages, seed)
    ready = [Barrier(2 if gate_up else 1) for _ in range(stages)]
    empty = [Barrier(2 if coop else 1) for _ in range(stages)]
    orders = [Barrier(1), Barrier(1)]
    tiles = list(range(pid, n_tiles_total, nprogs))
    dead = {t for t in tiles if random.Random(seed * 7919 + t).random() < 0.25}

    def producer():
        c = 0
        for tile in tiles:
            if tile in dead:
                continue
            for _kt in range(k_tiles):
                s = c % stages
                yield ("wait", empty[s], ((c // stages) & 1) ^ 1)
                if gate_up:
                    ready[s].expect(2)
                    sim.fill(s, c, "gate", ready[s], 1)
                    sim.fill(s, c, "up", ready[s], 1)
                    # cp.async rows: land at some time; handed over copy_depth stages later
                    sim.fill(s, c, "rows", None, 0)
                    yield None
                    done = c - copy_depth
                    if done >= 0:
                        yield from wait_rows(done)
                        ready[done % stages].arrive()
                else:
                    ready[s].expect(2)
                    sim.fill(s, c, "act", ready[s], 1)
                    sim.fill(s, c, "w", ready[s], 1)
                yield None
                c += 1
        if gate_up:
            for d in range(copy_depth):
                done = c - copy_depth + d
                if done >= 0:
                    yield from wait_rows(done)
                    ready[done % stages].arrive()

    def wait_rows(pos):
        # cp.async.wait_group: the producer's own row copies of position pos have landed
        while "rows" not in sim.landed[pos % stages] or sim.data[pos % stages] != pos:
            assert sim.data[pos % stages] == pos, "row copies of a position overwritten before hand-over"
            yield ("wait", _Landed(sim, pos), 0)

    def consumer(which):
        i = 0
        parts = {"gate", "up", "rows"} if gate_up else {"act", "w"}
        live = [t for t in tiles if t not in dead]
        for j, tile in enumerate(live):
            c = j * k_tiles
            if coop and which == 1 and random.Random(seed * 104729 + tile).random() < 0.3:
                for _kt in range(k_tiles):  # a padding half: no wgmma, the stages freed in turn
                    s = c % stages
                    if skip_waits:
                        yield ("wait", ready[s], (c // stages) & 1)
                    empty[s].arrive()
                    yield None
                    c += 1
                continue
            if not coop and j % 2 != which:
                continue
            if order and not coop and (which == 1 or i > 0):
                yield ("wait", orders[1 - which], (i + which - 1) & 1)
            prev = None
            for kt in range(k_tiles):
                s = c % stages
                yield ("wait", ready[s], (c // stages) & 1)
                sim.read(s, c, parts, f"consumer {which}")
                yield None
                # wgmma_wait(1): the previous step's wgmma is done; release its stage
                if prev is not None:
                    sim.reading[prev].discard(f"consumer {which}")
                if kt > 0:
                    empty[(c + stages - 1) % stages].arrive()
                prev = s
                c += 1
            if order and not coop:
                orders[which].arrive()
            i += 1
            yield None
            sim.reading[prev].discard(f"consumer {which}")  # wgmma_wait(0)
            empty[(c + stages - 1) % stages].arrive()
            yield None  # epilogue

    sim.run({"producer": producer(), "consumer 0": consumer(0), "consumer 1": consumer(1)})


class _Landed:
    """A wait condition: position pos's row copies have landed (cp.async.wait_group)."""

    def __init__(self, sim, pos):
        self.sim, self.pos = sim, pos

    def passes(self, parity):
        s = self.pos % self.sim.stages
        return "rows" in self.sim.landed[s] and self.sim.data[s] == self.pos


CASES = [  # (tiles in the grid, K steps a tile, ring stages, programs, this program)
    (7, 12, 6, 2, 0), (7, 12, 6, 2, 1), (9, 3, 4, 1, 0), (5, 1, 4, 1, 0), (6, 5, 5, 3, 2), (1, 7, 6, 1, 0),
    (0, 4, 4, 1, 0), (11, 2, 5, 2, 1),
]


@pytest.mark.parametrize("gate_up", [False, True], ids=["down", "gate_up"])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_protocol_has_no_race_and_no_deadlock(case, gate_up):
    n_tiles, k_tiles, stages, nprogs, pid = case
    for seed in range(150):
        run_protocol(n_tiles, k_tiles, stages, nprogs, pid, seed, gate_up)


@pytest.mark.parametrize("gate_up", [False, True], ids=["down", "gate_up"])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_cooperative_protocol_has_no_race_and_no_deadlock(case, gate_up):
    n_tiles, k_tiles, stages, nprogs, pid = case
    for seed in range(150):
        run_protocol(n_tiles, k_tiles, stages, nprogs, pid, seed, gate_up, coop=True)


def test_cooperative_skip_must_wait_for_each_stage():
    """Consumer 1 freeing a padding half's stages without waiting for their fills: its arrivals can
    complete a phase of "empty" that consumer 0 has not freed, and the producer overwrites a stage under
    consumer 0's wgmma (or the model deadlocks)."""
    failures = 0
    for seed in range(300):
        try:
            run_protocol(9, 4, 4, 1, 0, seed, False, coop=True, skip_waits=False)
        except AssertionError:
            failures += 1
    assert failures > 0


def test_without_the_ordering_barrier_consumer_1_reads_early():
    """The ordering barrier is needed: without it some interleaving lets consumer 1 pass a parity wait on
    a fresh (or one-lap-old) ready barrier and read a stage before its data (or deadlocks)."""
    failures = 0
    for seed in range(200):
        try:
            run_protocol(6, 12, 6, 1, 0, seed, False, order=False)
        except AssertionError:
            failures += 1
    assert failures > 0
