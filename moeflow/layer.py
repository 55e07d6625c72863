"""MoELayer: the one forward that strings the stages together.

    routing = run_router(router_weights, spec, x_TH)                 # moeflow.routing.router
    handle  = dispatcher.dispatch(x_TH, routing, spec, fused=...)    # Local | AllToAll | AllReduce
    y       = source.run(impl, handle.batch, config, step_input=x_TH)   # Resident | Offloaded
    out_TH  = dispatcher.combine(y, handle) + shared(x_TH)

Expert parallelism is a dispatcher choice (`moeflow.parallel.ep.shard_layer`), offload a
source choice (`moeflow.offload.attach_offload`), and the experts implementation
(reference | grouped | triton | triton_bi) a third, independent one: they compose, and
none of them subclasses, wraps or patches this class.

Legend: B batch, S sequence, T = B*S tokens, H hidden size, E routed experts, Z LongCat
zero experts, E+Z router columns, K picks per token, I intermediate size per expert,
V vocabulary (hash layers), N (token, slot) rows sent to routed experts.

Tensor storage (no copies, `moeflow.refs`): router tensors are registered on the layer by
reference under router_weight, router_bias, selection_bias, expert_scale, prenorm_weight,
hash_table, shared_gate_weight; the resident experts' tensors on the child module
`source` (gate_up, down, gate_up_bias, down_bias); the shared expert is the child module
`shared_expert`. A narrowed Parameter is registered as `<name>_full`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ExpertWeights, MoEConfig
from .experts.options import KernelOptions
from .experts.select import select_experts_impl
from .experts.shared import SharedExpertRunner, swiglu_parts
from .experts.source import ResidentExperts, run_impl
from .parallel.local import LOCAL
from .refs import TensorRefs
from .routing.router import RouterWeights, run_router
from .routing.router import router_input as _router_input
from .types import Dispatcher, ExpertBatch, ExpertSource, PairBatch, RoutingResult

__all__ = ["MoELayer", "run_experts", "routed_forward"]

# MoELayer storage name -> RouterWeights field.
_ROUTER_FIELDS = {
    "router_weight": "weight_EH",
    "router_bias": "router_bias_E",
    "selection_bias": "selection_bias_E",
    "expert_scale": "expert_scale_E",
    "prenorm_weight": "prenorm_weight_H",
    "hash_table": "hash_table_VK",
}
_EXPERT_TENSORS = ExpertWeights.TENSOR_FIELDS


def _check_routing_shapes(x_TH: torch.Tensor, routing: RoutingResult, K: int) -> None:
    T = int(x_TH.shape[0])
    ids_TK, weights_TK = routing.ids_TK, routing.weights_TK
    if ids_TK.shape != (T, K) or weights_TK.shape != (T, K):
        raise ValueError(
            f"routing: ids {tuple(ids_TK.shape)} / weights {tuple(weights_TK.shape)}, "
            f"expected ({T}, K={K}) for x_TH {tuple(x_TH.shape)}"
        )


def routed_forward(
    x_TH: torch.Tensor,
    routing: RoutingResult,
    config: MoEConfig,
    *,
    dispatcher: Dispatcher,
    run: Callable[[object, ExpertBatch], torch.Tensor],
    requested: object = "auto",
    on_handle: Callable[[object], None] | None = None,
    quant: object = None,
    options: object = None,
) -> tuple[torch.Tensor, object]:
    """dispatch -> experts -> combine for one routing: the routed part of every MoE forward.

    Args:
        x_TH: [T, H] expert input, dtype and device of the experts.
        routing: ids_TK int [T, K] (ids >= E are zero experts), weights_TK float [T, K].
        config: the layer's MoEConfig.
        dispatcher: a Dispatcher (moeflow.types).
        run: (impl, batch) -> y, the expert source's step.
        requested: experts impl name ("auto", "reference", ...) or an impl object.
        on_handle: called with the dispatch handle (diagnostics).
        quant: the experts' QuantSpec (quantized weights select an impl that runs them), or None.
        options: the KernelOptions a named Triton impl runs with (moeflow.experts.options), or None.

    Returns:
        (out_TH [T, H] in x's dtype, the impl that ran). out = sum over k in slot order of
        w[t, k] * expert(x[t]) accumulated in f32; zero experts add w * x; with
        router.weight_on_input (llama4) the expert input is w * x and the weight is 1.
    """
    spec = config.router
    _check_routing_shapes(x_TH, routing, spec.top_k)
    T = int(x_TH.shape[0])
    impl = requested
    if isinstance(requested, str) and dispatcher.fuses:
        # One device: the impl for these T tokens decides whether the fused form is used.
        # (Under EP the impl follows the rows that arrive: chosen once, after dispatch.)
        impl = select_experts_impl(config, x_TH.device, T, requested, quant=quant, options=options)
    fused = dispatcher.fuses and spec.num_zero_experts == 0 and getattr(impl, "forward_tokens", None) is not None
    if T == 0 and dispatcher.fuses:
        return x_TH.new_zeros(0, config.hidden_size), impl
    handle = dispatcher.dispatch(x_TH, routing, spec, fused=fused)
    if on_handle is not None:
        on_handle(handle)
    batch = handle.batch
    if isinstance(batch, PairBatch) and isinstance(requested, str) and not dispatcher.fuses:
        # Rows arrive from other ranks: the impl (and its tiles) follows the rows computed here.
        impl = select_experts_impl(config, x_TH.device, batch.num_tokens, requested, quant=quant, options=options)
    y = run(impl, batch)
    return dispatcher.combine(y, handle), impl


def run_experts(
    x_TH: torch.Tensor,
    routing: RoutingResult,
    w: ExpertWeights,
    config: MoEConfig,
    impl,
) -> torch.Tensor:
    """The routed part of a layer on one device, for given weights: dispatch, experts, combine.

    Args:
        x_TH: [T, H] expert input, dtype and device of the experts.
        routing: ids_TK int [T, K] (ids >= E are zero experts), weights_TK float [T, K].
        w: the experts' tensors (all E of them: ids index into w).
        config: the layer's MoEConfig.
        impl: an experts implementation (moeflow.experts.select).

    Returns:
        out_TH [T, H] in x's dtype (see `routed_forward`).
    """
    out_TH, _ = routed_forward(x_TH, routing, config, dispatcher=LOCAL,
                               run=lambda im, batch: run_impl(im, batch, w, config), requested=impl, quant=w.quant)
    return out_TH


class MoELayer(TensorRefs):
    """One Mixture-of-Experts layer built from a MoEConfig and the model's own tensors.

    Args (E+Z: router columns, = E without LongCat zero experts):
        config: MoEConfig.
        router_weight_EH: [E+Z, H] router linear weight (any float dtype; logits in f32).
        experts: ExpertWeights holding all E routed experts (layout and interleaving as
            config says: "linear" gate_up [E, 2I, H], down [E, H, I]; "matmul"
            gate_up [E, H, 2I], down [E, I, H]; biases [E, 2I] / [E, H] iff
            config.expert_bias; the experts' dtype is the activations' dtype), or an
            ExpertSource (moeflow.types: ResidentExperts, an offload source, a rank's subset).
        router_bias_E: [E+Z] router linear bias added to the logits (gpt-oss), or None.
        selection_bias_E: [E+Z] e_score_correction_bias (selection key only); required
            iff config.router.use_bias.
        expert_scale_E: [E+Z] per-expert weight scale (gemma4); iff router.expert_scale.
        prenorm_weight_H: [H] the router's RMSNorm scale (gemma4); iff
            router.router_prenorm. The router input is then
            rmsnorm(x) * prenorm_weight * H**-0.5, rmsnorm without a scale, in f32,
            eps = config.router_prenorm_eps (Gemma4TextRouter).
        hash_table_VK: int [V, K] token id -> expert ids (DeepSeek-V4 hash layers); iff
            router.hash_routing (forward then needs input_ids).
        router: a RouterWeights holding the router tensors at once (instead of the
            router_* keyword arguments above).
        shared_expert: any module x_TH -> y_TH (e.g. the HF MLP itself), added once.
        shared_gate_weight_1H: [1, H] qwen2_moe's shared_expert_gate weight; iff
            config.shared_gated: the shared output is sigmoid(x @ w.T) * shared(x).
        dispatcher: a Dispatcher (None: local, one device).
        experts_impl: "auto", "reference", "grouped", "triton", "triton_bi" (checked now;
            a refused choice raises ValueError with the implementation's reason), or an
            implementation object (tests, benchmarks).
        kernel_options: a moeflow.experts.options.KernelOptions the named Triton impls run with
            (tma / pdl / pinned kernel variants); None: the defaults.
        layer_idx: the layer's index (errors and traces name it).

    Attributes:
        source, dispatcher: the stages this layer runs.
        last_routing: the latest forward's RoutingResult (None before the first).
        graphs: a moeflow.layer_graphs.LayerGraphs: eligible steps replay from CUDA graphs
            cached per token count (None, the default: every step eager).
        last_handle: the latest dispatch handle of an expert-parallel dispatcher (None
            for the local one, whose handle would keep the step's rows alive).
        impl_name: name of the experts implementation the latest forward ran (before
            the first forward: the one chosen for a single token on the weights' device).
        check_routing: "eager" checks the GPU routing status after each eager step (one
            host sync); "deferred" adds it to `routing_monitor` (checked once per model
            forward without a sync, see moeflow.routing.monitor; what patch_model sets);
            "never" leaves it to the caller (`last_routing.check()`).
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        router_weight_EH: torch.Tensor | None = None,
        experts: ExpertWeights | ExpertSource | None = None,
        router_bias_E: torch.Tensor | None = None,
        selection_bias_E: torch.Tensor | None = None,
        expert_scale_E: torch.Tensor | None = None,
        prenorm_weight_H: torch.Tensor | None = None,
        hash_table_VK: torch.Tensor | None = None,
        router: RouterWeights | None = None,
        shared_expert: nn.Module | None = None,
        shared_gate_weight_1H: torch.Tensor | None = None,
        dispatcher: Dispatcher | None = None,
        experts_impl: object = "auto",
        layer_idx: int = 0,
        kernel_options: object = None,
    ) -> None:
        super().__init__()
        self.check_routing = "eager"
        self.routing_monitor = None  # a moeflow.routing.monitor.RoutingMonitor with check_routing="deferred"
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected MoEConfig, got {type(config).__name__}")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx={layer_idx!r}: expected an int >= 0")
        given = [router_weight_EH, router_bias_E, selection_bias_E, expert_scale_E, prenorm_weight_H, hash_table_VK]
        if router is not None:
            if not isinstance(router, RouterWeights):
                raise TypeError(f"router: expected RouterWeights, got {type(router).__name__}")
            if any(t is not None for t in given):
                raise ValueError("router: given together with router_* tensors; pass one or the other")
        else:
            if router_weight_EH is None:
                raise ValueError("router_weight_EH: None, expected the [E+Z, H] router weight (or router=)")
            router = RouterWeights(weight_EH=router_weight_EH, router_bias_E=router_bias_E,
                                   selection_bias_E=selection_bias_E, expert_scale_E=expert_scale_E,
                                   prenorm_weight_H=prenorm_weight_H, hash_table_VK=hash_table_VK,
                                   prenorm_eps=config.router_prenorm_eps)
        spec = config.router
        H = config.hidden_size
        source = self._as_source(experts, config)
        router.check(spec, hidden_size=H)
        if shared_gate_weight_1H is not None and not config.shared_gated:
            raise ValueError("shared_gate_weight_1H: given, but config.shared_gated is not set")
        if config.shared_gated and shared_gate_weight_1H is None:
            raise ValueError("shared_gate_weight_1H: None, but config.shared_gated is set")
        if shared_gate_weight_1H is not None:
            if not isinstance(shared_gate_weight_1H, torch.Tensor) or tuple(shared_gate_weight_1H.shape) != (1, H):
                shape = tuple(getattr(shared_gate_weight_1H, "shape", ()))
                raise ValueError(f"shared_gate_weight_1H: shape {shape}, expected (1, {H})")
            if shared_expert is None:
                raise ValueError("shared_expert: None, but config.shared_gated needs the shared expert it gates")
        if shared_expert is not None and not isinstance(shared_expert, nn.Module):
            raise TypeError(f"shared_expert: expected an nn.Module, got {type(shared_expert).__name__}")
        if dispatcher is None:
            dispatcher = LOCAL
        elif not isinstance(dispatcher, Dispatcher):
            raise TypeError(f"dispatcher: expected a Dispatcher (moeflow.types), got {type(dispatcher).__name__}")
        if not isinstance(experts_impl, str) and getattr(experts_impl, "forward_pairs", None) is None:
            raise TypeError(f"experts_impl: expected a str or an impl with forward_pairs, got "
                            f"{type(experts_impl).__name__}")

        if kernel_options is not None and not isinstance(kernel_options, KernelOptions):
            raise TypeError(f"kernel_options: expected a KernelOptions or None, got {type(kernel_options).__name__}")
        self.config = config
        self.layer_idx = layer_idx
        self.experts_impl = experts_impl
        self.kernel_options = kernel_options
        for name, fld in _ROUTER_FIELDS.items():
            self.set_ref(name, getattr(router, fld))
        self.set_ref("shared_gate_weight", shared_gate_weight_1H)
        self.set_source(source)
        self.shared_expert = shared_expert
        self.dispatcher = dispatcher
        self.last_routing: RoutingResult | None = None
        self.last_handle = None
        # A moeflow.layer_graphs.LayerGraphs replays this layer's steps from CUDA graphs (None: eager).
        self.graphs = None
        # Validates a named choice now (ValueError with the impl's reason) rather than at
        # the first forward.
        device = getattr(source, "device", None) or torch.device("cpu")
        if isinstance(experts_impl, str):
            impl0 = select_experts_impl(config, device, 1, experts_impl, quant=getattr(source, "quant", None),
                                        options=kernel_options)
        else:
            impl0 = experts_impl
        self.impl_name: str = str(getattr(impl0, "name", type(impl0).__name__))
        # The implementation object of the latest forward (impl_name is its name); LayerGraphs
        # asks it whether a step may be captured (`graph_capturable`).
        self.last_impl = impl0
        # A batch-invariant experts impl runs the SwiGLU shared expert too (else cuBLAS would
        # make the block's rows depend on the batch): moeflow.experts.shared.
        self.shared_runner: SharedExpertRunner | None = None
        if (shared_expert is not None and getattr(impl0, "batch_invariant", False)
                and config.activation in ("silu", "swiglu_clamp") and swiglu_parts(shared_expert) is not None):
            self.shared_runner = SharedExpertRunner(shared_expert, impl0, activation=config.activation,
                                                    swiglu_limit=config.swiglu_limit)

    @staticmethod
    def _as_source(experts, config: MoEConfig):
        if isinstance(experts, ExpertWeights):
            experts.check_config(config)
            if experts.num_experts != config.num_experts:
                raise ValueError(
                    f"experts: {experts.num_experts} experts (gate_up {tuple(experts.gate_up.shape)}), expected "
                    f"config.router.num_experts={config.num_experts}"
                )
            return ResidentExperts(experts)
        if experts is None or not isinstance(experts, ExpertSource):
            raise TypeError(f"experts: expected ExpertWeights or an ExpertSource, got {type(experts).__name__}")
        w = getattr(experts, "weights", None)
        if isinstance(w, ExpertWeights):
            w.check_config(config)
        return experts

    # -- the stages' tensors ------------------------------------------------------------

    @property
    def router_weights(self) -> RouterWeights:
        """The router tensors as they are now (rebuilt per call: `.to()` and re-bound tensors are seen)."""
        return RouterWeights(**{fld: self.ref(name) for name, fld in _ROUTER_FIELDS.items()},
                             prenorm_eps=self.config.router_prenorm_eps)

    @property
    def shared_gate_weight_1H(self) -> torch.Tensor | None:
        return self.ref("shared_gate_weight")

    @property
    def expert_weights(self) -> ExpertWeights:
        """The resident experts' tensors (ValueError when the source holds none, e.g. offloaded)."""
        w = getattr(self.source, "weights", None)
        if not isinstance(w, ExpertWeights):
            raise ValueError(f"layer {self.layer_idx}: its expert source {type(self.source).__name__} holds no "
                             f"resident ExpertWeights")
        return w

    @property
    def experts_dtype(self) -> torch.dtype | None:
        return getattr(self.source, "dtype", None)

    def rebind(self, **tensors: torch.Tensor | None) -> None:
        """Point named tensors at new ones (the HF adapter after `.to()` replaced a buffer).

        Names: router_weight, router_bias, selection_bias, expert_scale, prenorm_weight,
        hash_table, shared_gate_weight, and the expert tensors (gate_up, down, gate_up_bias,
        down_bias), which go to a resident source that serves all E experts (a rank's subset
        or an offload cache keeps its own tensors). None leaves a name as it is.
        """
        experts = {}
        for name, t in tensors.items():
            if t is None:
                continue
            if name in _ROUTER_FIELDS or name == "shared_gate_weight":
                self.set_ref(name, t)
            elif name in _EXPERT_TENSORS:
                experts[name] = t
            else:
                raise ValueError(f"rebind: unknown tensor {name!r}")
        rebind = getattr(self.source, "rebind", None)
        if experts and rebind is not None and getattr(self.source, "num_experts", None) == self.config.num_experts:
            rebind(**experts)

    def set_source(self, source: ExpertSource) -> None:
        """Serve the experts from `source` (offload attaches its slot cache this way)."""
        source = self._as_source(source, self.config)
        self._modules.pop("source", None)  # a plain-object source may replace a module one
        self.__dict__.pop("source", None)
        self.source = source

    def replace(self, *, source: ExpertSource | ExpertWeights | None = None, dispatcher: Dispatcher | None = None,
                experts_impl: object = None) -> MoELayer:
        """A new layer sharing this one's config, router tensors and shared expert, with other stages.

        What expert parallelism uses: `shard_layer` gives the sharded layer an all_to_all /
        all_reduce dispatcher and a source holding the rank's experts.
        """
        return type(self)(
            self.config,
            router=self.router_weights,
            experts=source if source is not None else self.source,
            shared_expert=self.shared_expert,
            shared_gate_weight_1H=self.shared_gate_weight_1H,
            dispatcher=dispatcher if dispatcher is not None else self.dispatcher,
            experts_impl=experts_impl if experts_impl is not None else self.experts_impl,
            layer_idx=self.layer_idx,
            kernel_options=self.kernel_options,
        )

    # -- pipeline ---------------------------------------------------------------------

    def router_input(self, x_TH: torch.Tensor) -> torch.Tensor:
        """What the router linear sees: x, or gemma4's rmsnorm(x) * scale * H**-0.5."""
        return _router_input(self.router_weights, x_TH)

    def route(self, x_TH: torch.Tensor, input_ids: torch.Tensor | None = None) -> RoutingResult:
        """Router logits (f32, + router bias) and the family's selection for x_TH [T, H].

        input_ids: int, T ids in any shape; needed by hash layers, ignored otherwise.
        """
        status_out = None
        if self.__dict__.get("_in_compiled_step"):
            kept = self.__dict__.get("_status_rows")
            T = x_TH.shape[0]
            if kept is not None and kept.device == x_TH.device and T <= kept.numel():
                status_out = kept[:T]
                kept_ids = self.__dict__.get("_ids_rows")
                if self.config.router.hash_routing and isinstance(input_ids, torch.Tensor):
                    # The status names a bad id from the ids it routed on: route on a copy the layer
                    # keeps (the op's input_ids may be a CUDA-graph input buffer, reused per replay).
                    if kept_ids is not None and input_ids.numel() == T:
                        input_ids = kept_ids[:T].copy_(input_ids.reshape(-1))
                    else:
                        status_out = None
        result = run_router(self.router_weights, self.config.router, x_TH, input_ids=input_ids,
                            layer=self.layer_idx, status_out=status_out)
        # The GPU selection reports NaN logits / bad hash ids through a device status,
        # not a sync. "eager" checks it here (one sync per layer, so a NaN is never a
        # silent pick); "deferred" hands it to the model's RoutingMonitor (one flag per
        # model forward, read without a sync; patch_model's default); under CUDA-graph
        # capture, or with "never", the caller owns the check (`self.last_routing.check()`).
        status = getattr(result, "status", None)
        if status is not None:
            if self.check_routing == "deferred" and self.routing_monitor is not None:
                self.routing_monitor.add(status)  # checked once per model forward, no sync here
            elif self.check_routing == "eager" and not torch.cuda.is_current_stream_capturing():
                result.check()
        return result

    def experts_forward(self, x_TH: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
        """The routed output [T, H] for a given routing (no shared expert): dispatch -> experts -> combine."""
        keep = None if self.dispatcher is LOCAL else self._keep_handle
        source = self.source
        out_TH, impl = routed_forward(
            x_TH, routing, self.config, dispatcher=self.dispatcher,
            run=lambda im, batch: source.run(im, batch, self.config, step_input=x_TH),
            requested=self.experts_impl, on_handle=keep, quant=getattr(source, "quant", None),
            options=self.kernel_options,
        )
        # Plain attributes set straight into __dict__: nn.Module.__setattr__ (which looks for a
        # Parameter / Module / buffer of that name first) cost ~5 us of host time per step.
        self.__dict__["impl_name"] = str(getattr(impl, "name", type(impl).__name__))
        self.__dict__["last_impl"] = impl
        return out_TH

    def _keep_handle(self, handle) -> None:
        self.last_handle = handle

    def shared_forward(self, x_TH: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output [T, H] (qwen2_moe: gated), or None without one."""
        if self.shared_expert is None:
            return None
        if self.shared_runner is not None:
            return self.shared_runner(x_TH, self.ref("shared_gate_weight"))
        shared_TH = self.shared_expert(x_TH)
        gate_w = self.ref("shared_gate_weight")
        if gate_w is not None:
            shared_TH = torch.sigmoid(F.linear(x_TH, gate_w)) * shared_TH
        return shared_TH

    def forward(
        self,
        x: torch.Tensor,
        *,
        input_ids: torch.Tensor | None = None,
        router_input: torch.Tensor | None = None,
        use_graphs: bool = True,
    ) -> torch.Tensor:
        """The layer's output, same shape and dtype as x.

        Args:
            x: [B, S, H] or [T, H], the experts' dtype and device. Under expert
                parallelism: this rank's tokens (all_to_all: T may differ per rank, even 0;
                all_reduce: the same tokens on every rank); collective.
            input_ids: token ids (T of them, any shape), for hash-routed layers.
            router_input: optional [..., H] tensor (T rows) the router sees instead of x;
                gemma4 routes on the residual stream while its experts see a
                differently normalised copy of it.
            use_graphs: False runs the step eagerly even where `graphs` would replay it (the
                step inside a torch.compile'd graph, moeflow.hf.op: CUDA graphs there are
                torch.compile's own).
        """
        H = self.config.hidden_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != H:
            raise ValueError(f"x: shape {tuple(x.shape)}, expected [B, S, {H}] or [T, {H}] (hidden_size={H})")
        w_dtype = self.experts_dtype
        if w_dtype is not None and x.dtype != w_dtype:
            raise TypeError(f"x: dtype {x.dtype}, expected the experts' dtype {w_dtype}")
        x_TH = x.reshape(-1, H)
        T = x_TH.shape[0]
        r_TH = x_TH
        if router_input is not None:
            if not isinstance(router_input, torch.Tensor) or router_input.shape[-1] != H or (
                router_input.numel() != T * H
            ):
                shape = tuple(router_input.shape) if isinstance(router_input, torch.Tensor) else None
                raise ValueError(f"router_input: shape {shape}, expected {T} rows of H={H}")
            r_TH = router_input.reshape(-1, H)
        if input_ids is not None and isinstance(input_ids, torch.Tensor) and input_ids.numel() != T:
            raise ValueError(f"input_ids: {input_ids.numel()} ids, expected one per token (T={T})")
        graphs = self.graphs
        if use_graphs and graphs is not None and graphs.eligible(self, x_TH, input_ids, router_input):
            out_TH = graphs.run(self, x_TH, self._step)
        else:
            out_TH = self._step(x_TH, input_ids=input_ids, r_TH=r_TH)
        return out_TH.view(x.shape)

    def _step(self, x_TH: torch.Tensor, *, input_ids: torch.Tensor | None = None,
              r_TH: torch.Tensor | None = None) -> torch.Tensor:
        """One validated step: route (on r_TH, default x_TH) -> experts -> + shared expert; out [T, H]."""
        # An expert-parallel dispatcher pairs this step's collectives with the other ranks'. A
        # refusal anywhere in the step (a NaN routing before the dispatch, an experts error
        # before the combine) must still reach them, or their pending collectives would pair
        # with this rank's next step: the dispatcher opens the step here and is told of the error.
        begin = getattr(self.dispatcher, "begin_step", None)
        if begin is not None:
            begin(self.layer_idx)
        try:
            routing = self.route(x_TH if r_TH is None else r_TH, input_ids=input_ids)
            self.__dict__["last_routing"] = routing  # a plain attribute (see experts_forward)
            out_TH = self.experts_forward(x_TH, routing)
        except BaseException as exc:
            if begin is not None:
                self.dispatcher.abort_step(x_TH, self.config.router, exc)
            raise
        shared_TH = self.shared_forward(x_TH)
        if shared_TH is not None:
            out_TH = out_TH + shared_TH
        return out_TH

    def token_stats(self) -> dict[str, int]:
        """Pair counts of the latest forward of an expert-parallel layer (see the dispatcher)."""
        if self.last_handle is None:
            raise ValueError("token_stats: no expert-parallel forward has run yet")
        return self.dispatcher.token_stats(self.last_handle)

    def _apply(self, fn, *args, **kwargs):
        # A layer loaded with local experts only may keep meta placeholders; .to()/.cuda()
        # must leave those alone (they cannot be copied).
        out = super()._apply(lambda t: t if t.is_meta else fn(t), *args, **kwargs)
        if "_status_rows" in self.__dict__:
            self.prepare_compiled()  # prepared once (patch_model): again on the layer's new device
        return out

    # Rows of routing status a compiled step writes into memory the layer keeps (64 KiB a layer):
    # every decode batch and most prefills; a longer step under torch.compile takes fresh rows.
    COMPILED_STATUS_ROWS = 16384

    def prepare_compiled(self) -> None:
        """Allocate now what a step inside torch.compile keeps across calls (moeflow.hf.op).

        On CUDA: the routing status rows (int32 [COMPILED_STATUS_ROWS]) the compiled step's router
        writes and the model's RoutingMonitor reads after the forward, for hash layers the token
        ids it routes on (int64 [COMPILED_STATUS_ROWS], a bad one is named from them), and the GPU
        router's per-device buffers. Made here, outside any CUDA-graph memory pool: torch.compile's
        cudagraph trees (mode="reduce-overhead") refuse a tensor of their pool that outlives a
        recorded call without being one of its outputs. patch_model and `.to()` call this.
        """
        w = self.ref("router_weight")
        dev = w.device if w is not None else torch.device("cpu")
        if dev.type != "cuda":
            self.__dict__["_status_rows"] = self.__dict__["_ids_rows"] = None
            return
        from .routing.gpu import reserve_device

        reserve_device(dev)
        kept = self.__dict__.get("_status_rows")
        if kept is None or kept.device != dev:
            self.__dict__["_status_rows"] = torch.zeros(self.COMPILED_STATUS_ROWS, dtype=torch.int32, device=dev)
            # hash layers: the token ids the compiled step routes on (RoutingStatus names a bad one)
            self.__dict__["_ids_rows"] = (torch.zeros(self.COMPILED_STATUS_ROWS, dtype=torch.int64, device=dev)
                                          if self.config.router.hash_routing else None)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"layer={self.layer_idx}, E={c.num_experts}, K={c.top_k}, H={c.hidden_size}, I={c.intermediate_size}, "
            f"activation={c.activation!r}, layout={c.layout!r}, impl={self.impl_name!r}, "
            f"dispatcher={self.dispatcher.name!r}"
        )
