"""`moeflow demo`: a tiny MoE model, loaded with transformers, patched, generating.

    run_demo()                      # the embedded trained model (moeflow/assets/tiny-moe): real text
    run_demo(model="random")        # a fixed-seed random tiny Mixtral, saved and reloaded
    run_demo(model="path/to/ckpt")  # any supported checkpoint directory

The embedded model is a 3.4M-parameter Mixtral-family MoE trained on Python's
standard-library sources, byte-level (token = byte + 3), so its prompt is text and
its output is decoded back to text. Steps for the random model: build a tiny
Mixtral-like CausalLM with fixed-seed weights (or take `model`: a callable
returning a transformers model), save it as
safetensors in a temporary directory, load it back with AutoModelForCausalLM, generate
`tokens` tokens greedily with the unpatched model, patch it with moeflow, generate again
(each generation with a tqdm bar), and print the per-layer expert load and whether the tokens agree.
Runs in a few seconds on 2 CPU cores. `tokens` must fit the model's context with the
prompt (max_position_embeddings; refused by name otherwise, before the model is built).

Legend: E routed experts, K picks per token, H hidden size.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The trained checkpoint shipped in the package (see its README.md for how it was made).
EMBEDDED_MODEL = Path(__file__).resolve().parent / "assets" / "tiny-moe"
EMBEDDED_PROMPT = "class Queue:\n    def __init__(self"
_BYTE_OFFSET = 3  # ByT5 convention of the embedded model: pad 0, eos 1, unk 2, byte b -> b + 3

# The tiny model: big enough that routing is not trivial (8 experts, top-2), small
# enough that 32 greedy tokens take well under a second per run on a laptop CPU.
DEMO_CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
DEMO_SEED = 0
PROMPT_LEN = 8


@dataclass(frozen=True)
class DemoResult:
    """What the demo saw: prompt and generated ids, per-layer expert loads, and the verdict."""

    prompt: list[int]
    reference_tokens: list[int]
    moeflow_tokens: list[int]
    expert_load: dict[str, list[int]]  # block path -> tokens routed to each expert (prompt + decode)
    report: str
    seconds_reference: float
    seconds_moeflow: float

    @property
    def identical(self) -> bool:
        return self.reference_tokens == self.moeflow_tokens


def build_tiny_mixtral(seed: int = DEMO_SEED):
    """The demo's tiny Mixtral-like model (fp32, eval mode, fixed-seed random weights)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**DEMO_CONFIG))
    return model.eval()


class _TqdmStreamer:
    """A generate() streamer that advances a tqdm bar once per new token (the prompt is skipped)."""

    def __init__(self, total: int, desc: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="tok", leave=True)
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


def _generate(model, prompt_1S: torch.Tensor, tokens: int, streamer=None) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt_1S, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             streamer=streamer, pad_token_id=0)
    return out[0, prompt_1S.shape[1]:].tolist()


def _count_loads(model) -> tuple[dict[str, list[int]], list]:
    """Forward hooks that add each step's picks to a per-block expert histogram."""
    from .hf import MoEBlock

    loads: dict[str, list[int]] = {}
    handles = []
    for path, module in model.named_modules():
        if not isinstance(module, MoEBlock) or module.__dict__["_moeflow"].exposed_by is not module:
            continue
        layer = module.moe_layer
        E = layer.config.num_experts
        loads[path] = [0] * E

        def hook(mod, args, output, path=path, layer=layer, E=E):
            ids = layer.last_routing.ids_TK.reshape(-1).to("cpu", torch.long)
            counts = torch.bincount(ids[ids < E], minlength=E).tolist()
            loads[path] = [a + b for a, b in zip(loads[path], counts)]

        handles.append(module.register_forward_hook(hook))
    return loads, handles


def run_demo_result(
    out: Callable[[str], Any] = print,
    device: str | torch.device | None = None,
    *,
    tokens: int = 32,
    model: str | os.PathLike | Callable[[], Any] | None = None,
    experts: str = "auto",
    seed: int = DEMO_SEED,
) -> DemoResult:
    """The demo, returning what it saw (see the module docstring). `out` gets each line."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens={tokens!r}: expected an int >= 1")
    device = _resolve_device(device)
    if model is None:
        model = EMBEDDED_MODEL if (EMBEDDED_MODEL / "config.json").is_file() else "random"
    if model == "random":
        model = None
    if not callable(model):  # a callable's model is known once built: checked before generating
        _check_tokens(tokens, *_context_and_prompt(model))
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # The tiny model's matrices are a few KB: extra CPU threads only add sync overhead
        # (several times slower on a busy 2-core machine), so the demo runs single-threaded.
        torch.set_num_threads(1)
    try:
        return _run(out, device, tokens=tokens, model=model, experts=experts, seed=seed)
    finally:
        torch.set_num_threads(threads)


def _context_and_prompt(model: str | os.PathLike | None) -> tuple[int | None, int]:
    """(the model's context, the demo prompt's length in tokens) without building the model.

    model: None (the random tiny Mixtral) or a checkpoint directory (its config.json is read).
    """
    if model is None:
        return int(DEMO_CONFIG["max_position_embeddings"]), PROMPT_LEN
    from .inspect import load_config

    cfg = load_config(Path(model)).get_text_config()
    return _config_context_and_prompt(cfg)


def _config_context_and_prompt(text_config) -> tuple[int | None, int]:
    context = getattr(text_config, "max_position_embeddings", None)
    byte_level = int(text_config.vocab_size) == 256 + _BYTE_OFFSET
    return (None if context is None else int(context)), (len(EMBEDDED_PROMPT.encode()) if byte_level else PROMPT_LEN)


def _check_tokens(tokens: int, context: int | None, prompt_len: int) -> None:
    """ValueError when the prompt and `tokens` new tokens do not fit the model's context."""
    if context is not None and prompt_len + tokens > context:
        raise ValueError(f"tokens={tokens}: the prompt's {prompt_len} tokens + {tokens} new ones exceed the model's "
                         f"context of {context} (max_position_embeddings); expected at most "
                         f"{max(0, context - prompt_len)} tokens")


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """`device`, or cuda when available, else cpu; ValueError before any model is built when it cannot run."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device={device!r}: unknown device; expected 'cpu' or 'cuda'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: the demo does not run on {dev.type!r} devices; expected 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine; expected 'cpu' "
                         f"(or no --device: cuda when available, else cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _run(out, device: torch.device, *, tokens: int, model, experts: str, seed: int) -> DemoResult:
    from transformers.utils import logging as hf_logging

    # The demo's own lines and bar only: no load/save warnings or progress bars.
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        loaded = _load(out, device, model, seed)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return _generate_and_compare(out, device, loaded, tokens=tokens, experts=experts, seed=seed)


def _load(out, device: torch.device, model, seed: int):
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="moeflow-demo-") as tmp:
        if model is None or callable(model):
            src = build_tiny_mixtral(seed) if model is None else model()
            what = "tiny Mixtral-like model" if model is None else type(src).__name__
            c = src.config
            out(f"moeflow demo: {what}: {c.num_hidden_layers} layers, H={c.hidden_size}, "
                f"E={getattr(c, 'num_local_experts', '?')}, K={getattr(c, 'num_experts_per_tok', '?')}, seed {seed}")
            src.save_pretrained(tmp)
            del src
            path = tmp
            size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.endswith(".safetensors"))
            out(f"saved as safetensors in {tmp} ({size / 1e6:.2f} MB)")
        else:
            path = os.fspath(model)
            out(f"moeflow demo: checkpoint {path}")
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        loaded = loaded.to(device).eval()
        out(f"loaded back with AutoModelForCausalLM: {type(loaded).__name__} on {device}")
    return loaded


def _generate_and_compare(out, device: torch.device, loaded, *, tokens: int, experts: str, seed: int) -> DemoResult:
    from .hf import patch_model

    vocab = int(loaded.config.get_text_config().vocab_size)
    _check_tokens(tokens, *_config_context_and_prompt(loaded.config.get_text_config()))
    byte_level = _is_byte_level(loaded)
    if byte_level:
        prompt_1S = torch.tensor([[b + _BYTE_OFFSET for b in EMBEDDED_PROMPT.encode()]], device=device)
        out(f"prompt: {EMBEDDED_PROMPT!r}")
    else:
        gen = torch.Generator().manual_seed(seed)
        prompt_1S = torch.randint(0, vocab, (1, PROMPT_LEN), generator=gen).to(device)
        out(f"prompt ids: {prompt_1S[0].tolist()}")

    t0 = time.perf_counter()
    ref = _generate(loaded, prompt_1S, tokens, streamer=_TqdmStreamer(tokens, "unpatched generate"))
    t_ref = time.perf_counter() - t0

    report = patch_model(loaded, experts=experts)
    out(str(report))
    loads, handles = _count_loads(loaded)
    try:
        t0 = time.perf_counter()
        mine = _generate(loaded, prompt_1S, tokens, streamer=_TqdmStreamer(tokens, "moeflow generate"))
        t_mine = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()

    out(f"generated {tokens} tokens greedily: {mine}")
    if byte_level:
        text = bytes(t - _BYTE_OFFSET for t in mine if t >= _BYTE_OFFSET).decode("utf-8", errors="replace")
        out("as text:\n" + EMBEDDED_PROMPT + text)
    out("expert load per layer (token picks routed to each expert, prompt + decode):")
    for path, load in loads.items():
        total = max(1, sum(load))
        bar = " ".join(f"e{e}:{n}" for e, n in enumerate(load))
        out(f"  {path}: {bar}  (max share {max(load) / total:.0%})")
    result = DemoResult(prompt=prompt_1S[0].tolist(), reference_tokens=ref, moeflow_tokens=mine, expert_load=loads,
                        report=str(report), seconds_reference=t_ref, seconds_moeflow=t_mine)
    verdict = "yes" if result.identical else "NO"
    out(f"output tokens identical to the unpatched model: {verdict} "
        f"(unpatched {t_ref:.2f} s, moeflow {t_mine:.2f} s)")
    if not result.identical:
        first = next(i for i, (a, b) in enumerate(zip(ref, mine)) if a != b)
        out(f"  first difference at token {first}: unpatched {ref[first]}, moeflow {mine[first]}")
    return result


def _is_byte_level(model) -> bool:
    """The embedded model's convention: 259 ids = 3 specials + 256 bytes."""
    return int(model.config.get_text_config().vocab_size) == 256 + _BYTE_OFFSET


def run_demo(
    out: Callable[[str], Any] = print,
    device: str | torch.device | None = None,
    *,
    tokens: int = 32,
    model: str | os.PathLike | Callable[[], Any] | None = None,
    experts: str = "auto",
    seed: int = DEMO_SEED,
) -> int:
    """`moeflow demo`: run the demo; the exit code is 0 when the tokens match the unpatched model, else 1."""
    result = run_demo_result(out, device, tokens=tokens, model=model, experts=experts, seed=seed)
    return 0 if result.identical else 1
