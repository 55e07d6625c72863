"""Expert parallelism when one rank refuses a step: never a wrong result, never a hang.

Legend: W ranks, F the rank that fails (1), L the MoE layer it fails at, B batch, S sequence,
T = B*S tokens, H hidden, V vocabulary, E experts, K picks, Tm the static token budget.

Spawned gloo ranks (W = 2 and 4) run a tiny model (embedding, three residual MoE layers with
the reference experts, head: logits [B, S, V]) whose layers are sharded with `shard_layer`
(`timeout_s` set), through four forwards: a clean one, the faulty one, and two clean ones.
Each scenario runs on a fresh process group (a failure breaks the group):

    nan_hidden   rank F's MoE layer L gets a NaN hidden state (its router refuses it before
                 any collective of the step)
    block_error  rank F's experts raise inside layer L (after the dispatch, before the combine)
    over_static  rank F alone passes more tokens than static_tokens (all_to_all static only:
                 all_reduce has no token budget)
    skip_layer   rank F never calls MoE layer L (it goes on to layer L + 1)

in the modes all_to_all (dynamic), all_to_all with static_tokens, and all_reduce. The
"+deferred" modes run nan_hidden and block_error with the step headers checked on the device
only (what CUDA without `timeout_s` does: `EPStep.read_now` answers False), and call
`check_steps(group)` after every forward, as such a caller would; there block_error fails
the last layer, so that its NaN output reaches the logits.

On every call every rank either returns the one-process model's logits (rtol = 1e-5,
atol = 1e-5 * max |logits|, as the suite's whole-model checks; max-abs and RMS shown on
failure) or raises a named error: an EPCollectiveError (EPStepAborted, EPStepMismatch,
EPGroupBroken, ...) or, on rank F's faulty call, the refusal it was given. (EPInputMismatch
does not count: every rank's tokens are the same in all_reduce mode here, so it would be a
stale pairing's false verdict.) The faulty call raises on every rank at once (the others
learn of it from the step's header exchange, not from a timeout), and every process exits
cleanly. Deferred: a forward may instead return logits that are all NaN, and then
`check_steps` raises a named error.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ep_spawn import free_port
from torch import nn

TIMEOUT_S = 5.0  # every EP collective's limit: a rank left waiting fails, it does not hang
FAULTY = 1  # the rank that fails
CALLS = 4  # clean, faulty, clean, clean
FAULT_CALL = 1
MODES = ("all_to_all", "all_to_all_static", "all_reduce")
SCENARIOS = ("nan_hidden", "block_error", "over_static", "skip_layer")
STATIC_TOKENS = 12
H, V, E, K, LAYERS = 16, 29, 4, 2, 3
SPAWN_S = 90  # start-up allowance of a spawn (importing torch on a loaded 2-core machine), plus 15 s a case


def _cases() -> list[tuple[str, str]]:
    plain = [(s, m) for s in SCENARIOS for m in MODES if s != "over_static" or m == "all_to_all_static"]
    return plain + [(s, f"{m}+deferred") for s in ("nan_hidden", "block_error") for m in MODES]


class _Armed:
    """A switch the fault injections read: on only for rank F's faulty call."""

    def __init__(self) -> None:
        self.on = False


class _RaisingImpl:
    """The reference experts, raising inside the block while armed (between dispatch and combine)."""

    def __init__(self, inner, armed: _Armed) -> None:
        self.inner, self.armed = inner, armed
        self.name = f"raising({inner.name})"

    def supports(self, config):
        return self.inner.supports(config)

    def forward_pairs(self, x_NH, expert_N, w, config):
        if self.armed.on:
            raise RuntimeError("injected experts failure")
        return self.inner.forward_pairs(x_NH, expert_N, w, config)


class TinyModel(nn.Module):
    """Embedding, LAYERS residual MoE layers (x + moe(rmsnorm(x))), rmsnorm, head: ids [B, S] -> logits [B, S, V].

    skip: layer indices this model does not call (a rank that never reaches a layer)."""

    def __init__(self, emb_VH: torch.Tensor, layers: list, head_VH: torch.Tensor) -> None:
        super().__init__()
        self.emb_VH, self.head_VH = emb_VH, head_VH
        self.layers = nn.ModuleList(layers)
        self.skip: set[int] = set()

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        h = self.emb_VH[ids_BS]
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                h = h + layer(nn.functional.rms_norm(h, (H,)))
        return nn.functional.rms_norm(h, (H,)) @ self.head_VH.t()


def _build(seed: int) -> tuple[torch.Tensor, list, torch.Tensor]:
    """The one-process model's tensors and MoE layers (layer_idx 0..LAYERS-1)."""
    from moeflow.config import ExpertWeights, MoEConfig
    from moeflow.layer import MoELayer
    from moeflow.routing.spec import RouterSpec

    g = torch.Generator().manual_seed(seed)
    cfg = MoEConfig(hidden_size=H, intermediate_size=8, activation="silu",
                    router=RouterSpec(score_fn="softmax", num_experts=E, top_k=K, renorm=True))
    layers = [MoELayer(cfg, router_weight_EH=torch.randn(E, H, generator=g) * 0.5,
                       experts=ExpertWeights(torch.randn(E, 16, H, generator=g) * 0.3,
                                             torch.randn(E, H, 8, generator=g) * 0.3),
                       experts_impl="reference", layer_idx=i)
              for i in range(LAYERS)]
    return torch.randn(V, H, generator=g), layers, torch.randn(V, H, generator=g)


def _ids(mode: str, rank: int, call: int, scenario: str) -> torch.Tensor:
    """The prompt of `call` on `rank`: all_reduce needs the same tokens on every rank."""
    r = 0 if mode == "all_reduce" else rank
    S = 5 + (r % 2)  # T = 10 or 12 tokens, within STATIC_TOKENS
    if scenario == "over_static" and call == FAULT_CALL and rank == FAULTY:
        S = 8  # 16 tokens on rank F alone
    g = torch.Generator().manual_seed(100 * call + r)
    return torch.randint(0, V, (2, S), generator=g)


def _is_injected(scenario: str, exc: BaseException) -> bool:
    """Rank F's own refusal on the faulty call."""
    if scenario == "nan_hidden":
        return isinstance(exc, ValueError) and "NaN" in str(exc)
    if scenario == "block_error":
        return isinstance(exc, RuntimeError) and "injected experts failure" in str(exc)
    if scenario == "over_static":
        return isinstance(exc, ValueError) and "static_tokens" in str(exc)
    return False


def _scenario(rank: int, W: int, scenario: str, mode: str) -> list[dict]:
    """Run the four calls of one scenario on a fresh group; one outcome per call."""
    from moeflow.experts.select import get_impl
    from moeflow.parallel.dist_utils import EPCollectiveError, EPStep, check_steps
    from moeflow.parallel.ep import shard_layer

    mode, deferred = mode.removesuffix("+deferred"), mode.endswith("+deferred")
    group = dist.new_group(list(range(W)))
    emb, ref_layers, head = _build(seed=7)
    ref = TinyModel(emb, ref_layers, head)
    # block_error deferred fails the last layer: its NaN output reaches the logits (earlier,
    # the next layer's router would refuse the NaN first).
    L = 0 if scenario == "over_static" else LAYERS - 1 if deferred and scenario == "block_error" else 1
    ids = [_ids(mode, rank, c, scenario) for c in range(CALLS)]
    with torch.no_grad():
        refs = [ref(i) for i in ids]
    static = STATIC_TOKENS if mode == "all_to_all_static" else None
    ep_mode = "all_reduce" if mode == "all_reduce" else "all_to_all"
    model = TinyModel(emb, [shard_layer(m, group=group, mode=ep_mode, static_tokens=static, timeout_s=TIMEOUT_S)
                            for m in ref_layers], head)
    armed = _Armed()
    if scenario == "nan_hidden":
        model.layers[L].register_forward_pre_hook(
            lambda _m, args: (args[0] * float("nan"), *args[1:]) if armed.on else None)
    elif scenario == "block_error":
        model.layers[L].experts_impl = _RaisingImpl(get_impl("reference"), armed)
    read_now = EPStep.read_now
    if deferred:
        EPStep.read_now = lambda self, device: False
    out = []
    try:
        for c in range(CALLS):
            fault = c == FAULT_CALL and rank == FAULTY
            armed.on = fault
            if fault and scenario == "skip_layer":
                model.skip = {L}
            t0 = time.monotonic()
            rec: dict = {"call": c}
            got = None
            try:
                try:
                    with torch.no_grad():
                        got = model(ids[c])
                finally:
                    if deferred:
                        # After every forward, raised or not, on every rank: the deferred verdicts.
                        rec["nan"] = got is not None and bool(torch.isnan(got).all())
                        try:
                            check_steps(group)
                        except EPCollectiveError:
                            if got is not None:
                                raise
            except Exception as exc:  # noqa: BLE001 - every outcome is recorded and judged by the parent
                named = isinstance(exc, EPCollectiveError) or (fault and _is_injected(scenario, exc))
                rec.update(kind="error", error=type(exc).__name__, named=named,
                           text="" if named else traceback.format_exc())
            else:
                want = refs[c]
                d = (got.double() - want.double()).abs()
                atol = 1e-5 * float(want.abs().max())
                ok = got.shape == want.shape and bool((d <= atol + 1e-5 * want.double().abs()).all())
                rec.update(kind="ok" if ok else "wrong", max_abs=float(d.max()), rms=float(d.pow(2).mean().sqrt()))
            finally:
                armed.on = False
                model.skip = set()
            rec["seconds"] = time.monotonic() - t0
            out.append(rec)
    finally:
        EPStep.read_now = read_now
    return out


def _worker(rank, W, port, q, cases):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                                timeout=datetime.timedelta(seconds=60))
        for case in cases:
            try:
                res = _scenario(rank, W, *case)
            except Exception:
                res = traceback.format_exc()
            q.put((rank, case, res))  # one by one: a rank that aborts later keeps what it reported
    except Exception:
        q.put((rank, "_setup", traceback.format_exc()))
    q.put((rank, "_done", None))
    q.close()
    q.join_thread()
    # A group broken by a refused step may still hold a peer's collective: leave without teardown.
    os._exit(0)


_RESULTS: dict[tuple, tuple[dict, list[int | None]]] = {}


def _spawn(W: int, cases: tuple[tuple[str, str], ...] | None = None) -> tuple[dict[int, dict], list[int | None]]:
    """Run the scenarios (all, or `cases`) on W gloo ranks: ({rank: {case: outcomes}}, exit codes).

    A rank that dies (an abort inside the backend) or stops reporting ends the wait soon
    after; its missing cases fail their tests."""
    cases = tuple(_cases()) if cases is None else cases
    if (W, cases) in _RESULTS:
        return _RESULTS[(W, cases)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, W, port, q, cases), daemon=True) for r in range(W)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {r: {} for r in range(W)}
    done: set[int] = set()
    deadline = time.monotonic() + SPAWN_S + 15 * len(cases)
    while len(done) < W and time.monotonic() < deadline:
        if any(p.exitcode is not None and r not in done for r, p in enumerate(procs)):
            deadline = min(deadline, time.monotonic() + 3 * TIMEOUT_S)  # a rank died: its peers time out
        try:
            rank, key, res = q.get(timeout=1.0)
        except Exception:
            continue
        if key == "_done":
            done.add(rank)
        else:
            out[rank][key] = res
    codes = []
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
        codes.append(p.exitcode)
    _RESULTS[(W, cases)] = (out, codes)
    return out, codes


def _show(rec: dict) -> str:
    nan = " (its logits were NaN)" if rec.get("nan") else ""
    if rec["kind"] == "error":
        return (f"call {rec['call']}: {rec['error']} ({rec['seconds']:.1f}s){'' if rec['named'] else ' UNNAMED'}"
                f"{nan}")
    return f"call {rec['call']}: {rec['kind']} max_abs={rec['max_abs']:.3e} rms={rec['rms']:.3e}"


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize(("scenario", "mode"), _cases())
def test_refused_step_never_corrupts(W, scenario, mode):
    res, codes = _spawn(W)
    _judge(res, codes, W, scenario, mode)


def _judge(res: dict[int, dict], codes: list[int | None], W: int, scenario: str, mode: str) -> None:
    """Assert what the module docstring promises for one case's outcomes on every rank."""
    for rank in range(W):
        assert "_setup" not in res[rank], res[rank]["_setup"]
    per_rank = {}
    for rank in range(W):
        got = res[rank].get((scenario, mode))
        assert got is not None, f"rank {rank} never reported this case (exit codes {codes}: a rank aborted or hung)"
        assert not isinstance(got, str), f"rank {rank}:\n{got}"
        per_rank[rank] = got
    table = "\n".join(f"rank {r}: " + "; ".join(_show(x) for x in recs) for r, recs in per_rank.items())
    for rank, recs in per_rank.items():
        assert recs[0]["kind"] == "ok", f"the clean first call failed:\n{table}"
        for rec in recs:
            if rec["kind"] == "wrong":
                raise AssertionError(f"rank {rank} returned wrong logits (rtol=1e-5, atol=1e-5*max):\n{table}")
            if rec["kind"] == "error" and not rec["named"]:
                raise AssertionError(f"rank {rank} raised an unnamed error:\n{table}\n{rec['text']}")
        fault = recs[FAULT_CALL]
        assert fault["kind"] == "error", f"rank {rank} did not raise on the faulty call:\n{table}"
        assert fault["seconds"] < TIMEOUT_S, f"rank {rank} learnt of the failure from a timeout:\n{table}"
        if mode.endswith("+deferred") and scenario == "block_error" and rank != FAULTY:
            assert fault.get("nan"), f"rank {rank}: an unread failed verdict must make the step's output NaN:\n{table}"


@pytest.mark.parametrize("W", [2, 4])
def test_every_rank_exits_cleanly(W):
    res, codes = _spawn(W)
    assert codes == [0] * W, f"exit codes {codes}: a rank aborted or was killed while hung"


# ---------------------------------------------------------------------------- the header, one process


def _steps_on(group: object, n: int, layer: int):
    """This process's n-th step of `layer` on a stand-in group (no collective is issued)."""
    from moeflow.parallel.dist_utils import begin_step

    step = None
    for _ in range(n):
        if step is not None:
            step.close()
        step = begin_step(group, layer=layer, owner=None, timeout_s=None)
    return step


def test_header_verdict_names_the_refusing_rank():
    from moeflow.parallel.dist_utils import STATUS_FAILED, EPGroupBroken, EPStepAborted, begin_step

    group = object()
    step = _steps_on(group, 3, layer=2)
    rows = [step.header() for _ in range(3)]
    rows[1] = step.header(STATUS_FAILED, 7)  # rank 1 failed during the step, a RuntimeError
    step.check(rows, final=False)  # remembered, not raised: the step's last collective comes first
    with pytest.raises(EPStepAborted, match=r"step 3 \(layer 2\).*rank 1 failed during it.*RuntimeError"):
        step.check([step.header()] * 3)
    with pytest.raises(EPGroupBroken, match="failed earlier"):
        begin_step(group, layer=0, owner=None, timeout_s=None)


def test_header_verdict_names_ranks_out_of_step():
    from moeflow.parallel.dist_utils import EPStepMismatch

    step = _steps_on(object(), 5, layer=1)
    rows = [step.header(), step.header(), [*step.header()[:2], 2, 0, 0], [7, 0, 0, 0, 0]]
    with pytest.raises(EPStepMismatch, match=r"rank 2 sent step 5 of layer 2; rank 3 sent something that is not"):
        step.check(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_summed_header_digits_are_exact(dtype):
    """The all_reduce header: each rank's digits in its block survive the sum exactly, bf16 too."""
    from moeflow.parallel.dist_utils import STATUS_REFUSED, SUM_HEADER_LEN, EPStepAborted

    W = 4
    steps = [_steps_on(object(), 300, layer=1000) for _ in range(W)]  # step 300 > 255, layer > 255
    areas = torch.zeros(W, 2 * W * SUM_HEADER_LEN, dtype=dtype)
    for r, st in enumerate(steps):
        st.write_sum_header(areas[r], r, *((STATUS_REFUSED, 1) if r == 3 else ()))
    total = areas.sum(0)  # what the all_reduce leaves on every rank
    blocks = total[: W * SUM_HEADER_LEN].view(W, SUM_HEADER_LEN).float().tolist()
    rows = steps[0].rows_from_sum(blocks)
    assert rows[:3] == [steps[0].header()] * 3
    assert rows[3] == steps[0].header(STATUS_REFUSED, 1)
    assert torch.equal(total[W * SUM_HEADER_LEN:], torch.zeros(W * SUM_HEADER_LEN, dtype=dtype))
    with pytest.raises(EPStepAborted, match="rank 3 refused it before sending its data"):
        steps[0].check(rows)
