"""The synchronisation protocol of the warp-specialised Gluon fp8 gate_up (moeflow/kernels/moe_gemm_fp8_gluon.py),
model-checked on the CPU.

The kernel cannot run here, and a wrong phase or a missing arrival costs a hung GPU call. So this replays its
protocol, step for step as the kernel issues it, against a model of the hardware's mbarriers (arrival counts,
transaction bytes, parity waits that pass when the barrier's completed-phase count has the other parity) under
thousands of random interleavings of the producer, the two consumers and the asynchronous copies, and asserts:
  - no deadlock: every agent finishes;
  - a consumer's wgmma reads a ring stage only when it holds this position's complete data (the TMA weight
    boxes landed, the row copies complete and handed over);
  - nothing overwrites a stage while a wgmma may still read it;
  - a consumer reads the other's row maxima of the same tile (the two exchange slots a consumer, by the
    tile's parity, are rewritten only after the other consumer has read them).
Mutations of the protocol (one exchange slot a consumer, a stage freed before its wgmma is done, rows
handed over before their copies complete) make it fail: the model can tell.
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


def run_protocol(n_tiles_total, k_tiles, stages, nprogs, pid, seed, copy_depth: int = 2, xchg_slots: int = 2,
                 free_early: bool = False, wait_copies: bool = True):
    """One CTA (program pid of nprogs) of moe_gate_up_fp8_ws_kernel. Some tiles (chosen by the seed) are all
    padding: every agent skips them (_ws_live). Mutations: xchg_slots 1 (each consumer's maxima in one slot
    whatever the tile's parity), free_early (a consumer frees the stage before its wgmma is done),
    wait_copies False (the producer hands a stage over without waiting for its row copies)."""
    sim = Sim(stages, seed)
    ready = [Barrier(2) for _ in range(stages)]  # the weight copies' expect + the rows' hand-over
    empty = [Barrier(2) for _ in range(stages)]  # both consumers free every stage
    xchg = Barrier(2)
    xbuf = {}  # exchange slot -> (tile index j, consumer) whose maxima it holds
    tiles = list(range(pid, n_tiles_total, nprogs))
    dead = {t for t in tiles if random.Random(seed * 7919 + t).random() < 0.25}

    def wait_rows(pos):
        # cp.async.wait_group: the producer's own row copies of position pos have landed
        while wait_copies and ("rows" not in sim.landed[pos % stages] or sim.data[pos % stages] != pos):
            assert sim.data[pos % stages] == pos, "row copies of a position overwritten before hand-over"
            yield ("wait", _Landed(sim, pos), 0)

    def producer():  # _fp8_ws_gate_up_load
        c = 0
        for tile in tiles:
            if tile in dead:
                continue
            for _kt in range(k_tiles):
                s = c % stages
                yield ("wait", empty[s], ((c // stages) & 1) ^ 1)
                ready[s].expect(4)
                for box in ("gate0", "up0", "gate1", "up1"):
                    sim.fill(s, c, box, ready[s], 1)
                sim.fill(s, c, "rows", None, 0)  # cp.async: lands at some time, no barrier
                yield None
                done = c - copy_depth  # _ws_rows_hand_over
                if done >= 0:
                    yield from wait_rows(done)
                    ready[done % stages].arrive()
                yield None
                c += 1
        for d in range(copy_depth):  # _ws_rows_drain
            done = c - copy_depth + d
            if done >= 0:
                yield from wait_rows(done)
                ready[done % stages].arrive()

    def consumer(which):  # _fp8_ws_gate_up_mma
        who = f"consumer {which}"
        parts = {"gate0", "up0", "gate1", "up1", "rows"}
        live = [t for t in tiles if t not in dead]
        for j, _tile in enumerate(live):
            c = j * k_tiles
            for _kt in range(k_tiles):  # _fp8_ws_gate_up_half
                s = c % stages
                yield ("wait", ready[s], (c // stages) & 1)
                sim.read(s, c, parts, who)
                if free_early:
                    empty[s].arrive()
                yield None
                sim.reading[s].discard(who)  # warpgroup_mma_wait(0)
                if not free_early:
                    empty[s].arrive()
                yield None
                c += 1
            # _fp8_ws_group_amax: own maxima into slot (j parity, which), arrive, wait for tile j's phase,
            # then the other's slot
            slot = ((j & 1) * 2 if xchg_slots == 2 else 0) + which
            xbuf[slot] = (j, which)
            xchg.arrive()
            yield ("wait", xchg, j & 1)
            yield None
            other = slot + 1 - 2 * which
            assert xbuf.get(other) == (j, 1 - which), (
                f"{who} at tile {j} reads slot {other} holding {xbuf.get(other)}")
            yield None  # the quantized stores

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


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_protocol_has_no_race_and_no_deadlock(case):
    n_tiles, k_tiles, stages, nprogs, pid = case
    for seed in range(150):
        run_protocol(n_tiles, k_tiles, stages, nprogs, pid, seed)


def _failures(seeds: int, k_tiles: int = 3, **mutation) -> int:
    failures = 0
    for seed in range(seeds):
        try:
            run_protocol(7, k_tiles, 4, 1, 0, seed, **mutation)
        except AssertionError:
            failures += 1
    return failures


def test_one_exchange_slot_lets_a_consumer_overwrite_maxima_not_yet_read():
    """Each consumer's maxima in one slot: a consumer that has passed tile j's exchange runs on and writes
    tile j + 1's maxima while the other still has tile j's to read (short K loops: the run-ahead is short)."""
    assert _failures(300, k_tiles=1, xchg_slots=1) > 0


def test_freeing_a_stage_before_the_wgmma_is_done_lets_the_producer_overwrite_it():
    assert _failures(300, free_early=True) > 0


def test_handing_rows_over_before_their_copies_complete_lets_a_wgmma_read_them_early():
    assert _failures(300, wait_copies=False) > 0
