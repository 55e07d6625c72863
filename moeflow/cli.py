"""The `moeflow` command: demo, info, route, bench, trace.

A user's mistake (a missing or malformed config.json, an unsupported family, a
CUDA-only option on CPU, an empty prompt, a corrupt trace, an output path that would
replace someone's file) prints exactly one line on stderr and exits 2:

    moeflow COMMAND: error: WHAT WENT WRONG (the field, its value, what was expected)[; hint: WHAT TO DO]

(the hint where there is one beyond the message). `--debug` (anywhere on the line) shows
the traceback instead. Every subcommand, including `trace record` and `bench routing` (the
benchmark script's own options), has `--help`; `moeflow --version` prints the version.

Files: every output path is checked before the work (`moeflow.paths`): an existing file is
replaced only when moeflow wrote it, or with `--force`; an input never.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

from .trace_command import add_trace_parser

# What a user can cause and fix: turned into the two-line message above. OSError covers a
# missing file, a directory where a file belongs and transformers' unreadable-checkpoint
# errors; ImportError a missing optional package.
_USER_ERRORS = (ValueError, TypeError, OSError, NotImplementedError, ImportError)


class UserError(Exception):
    """An error the user can fix: printed as one line plus a hint, exit code 2."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.ep is not None:
        from .demo_ep import run_ep_demo

        kwargs = {} if args.tokens is None else {"tokens": args.tokens}
        return int(run_ep_demo(expected_world=args.ep, **kwargs) or 0)
    from .demo import run_demo

    kwargs = {} if args.tokens is None else {"tokens": args.tokens}
    return int(run_demo(device=args.device, **kwargs) or 0)


def _cmd_info(args: argparse.Namespace) -> int:
    from .inspect import checkpoint_info, format_info, format_prediction, predict_checkpoint

    if args.gpu_budget is not None or args.json:
        from .predict import parse_bytes

        budget = None if args.gpu_budget is None else parse_bytes(args.gpu_budget, name="--gpu-budget")
        reserve = None if args.reserve is None else parse_bytes(args.reserve, name="--reserve")
        pred = predict_checkpoint(args.path, gpu_budget_bytes=budget, device=args.device or "h100",
                                  reserve_bytes=reserve)
        if args.json:
            import json

            print(json.dumps(pred, indent=1))
            return 0
    print(format_info(checkpoint_info(args.path, slots=args.slots)))
    if args.gpu_budget is not None:
        print(format_prediction(pred))
    if args.kernels:
        from .experts.plan_report import checkpoint_plans, device_for_report, format_plans

        device = device_for_report(args.device)
        print(f"\nkernel plan per T on {device.name} (compute capability {device.capability}, {device.sm_count} SMs)"
              + (" [no GPU here: planned for a named device]" if args.device is None and device.type == "cuda"
                 and not _cuda_available() else ""))
        print(format_plans(checkpoint_plans(args.path, device=device, batch_invariant=args.batch_invariant)))
    return 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cmd_route(args: argparse.Namespace) -> int:
    from .inspect import route_prompt

    print(route_prompt(args.path, args.prompt, max_tokens=args.max_tokens))
    return 0


_BENCH_MODULES = {
    "experts": "benchmarks.bench_experts",
    "routing": "benchmarks.bench_routing",
    "ep": "benchmarks.bench_ep",
    "offload": "benchmarks.bench_offload",
}


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.which is None:
        if args.help:
            args.parser.print_help()
            args.parser.exit(0)  # SystemExit(0), as argparse's own --help does
        args.parser.error(f"the following arguments are required: which (one of {', '.join(sorted(_BENCH_MODULES))})")
    if args.help:
        # `moeflow bench routing --help`: the script's own options.
        rest = [*rest, "--help"]
    name = _BENCH_MODULES[args.which]
    # The scripts live in the checkout's benchmarks/ folder, not in the installed package.
    import os

    if os.path.isdir("benchmarks") and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "benchmarks":
            raise _missing_package(args.which, exc) from exc
        raise UserError(
            f"benchmark {args.which!r} needs the repository's benchmarks/ folder ({exc.name} not importable)",
            "run it from a checkout of moeflow: cd moeflow && moeflow bench " + args.which,
        ) from exc
    dirs = ["."] + [rest[i + 1] for i, a in enumerate(rest[:-1]) if a in ("--out", "--out-dir")]
    before = _json_mtimes(dirs)
    argv0 = sys.argv[0]
    sys.argv[0] = f"moeflow bench {args.which}"  # the script's argparse names itself after argv[0]
    try:
        rc = int(module.main(list(rest)) or 0)
    except ModuleNotFoundError as exc:  # an optional package a mode of the script imports late (triton)
        raise _missing_package(args.which, exc) from exc
    finally:
        sys.argv[0] = argv0
    if args.plot:
        for path in sorted(p for p, t in _json_mtimes(dirs).items() if before.get(p) != t):
            print(f"plot: {_plot_bench_json(path, force=args.force)}")
    return rc


def _missing_package(which: str, exc: ModuleNotFoundError) -> UserError:
    top = (exc.name or str(exc)).split(".")[0]
    hint = f"pip install {top}"
    if top == "triton":
        hint = ("pip install 'moeflow[gpu]' (Triton); TRITON_INTERPRET=1 runs its interpreter on the CPU "
                "but still needs the package")
    return UserError(f"benchmark {which!r} needs the Python package {top!r}, which is not installed", hint)


def _json_mtimes(dirs: list[str]) -> dict[str, float]:
    """JSON files under the given directories (where the benchmark writes), by mtime."""
    import glob
    import os

    found = {}
    for d in dirs:
        for p in glob.glob(os.path.join(d, "**", "*.json"), recursive=True):
            if "tiny-moe" not in p:
                found[os.path.normpath(p)] = os.path.getmtime(p)
    return found


def _plot_bench_json(path: str, *, force: bool = False) -> str:
    """A PNG beside a benchmark JSON ({meta, rows}): roof_frac against T, else time against T.

    The PNG replaces an earlier one only when moeflow wrote it (or with --force).
    """
    import json

    from . import plots
    from .paths import check_output_file

    with open(path) as f:
        data = json.load(f)
    rows = data.get("rows", []) if isinstance(data, dict) else []
    metric = "roof_frac" if any(isinstance(r, dict) and r.get("roof_frac") is not None for r in rows) else "us"
    out = check_output_file(path[: -len(".json")] + f"_{metric}.png", "--plot", inputs=[("JSON", path)],
                            ours=plots.is_moeflow_png, force=force)
    plots.plot_vs_tokens(rows, out, metric=metric)
    return out


def _version() -> str:
    from . import __version__

    try:  # the installed distribution's metadata, when it is installed (it should agree)
        from importlib.metadata import version

        installed = version("moeflow")
    except Exception:
        installed = None
    return __version__ if installed in (None, __version__) else f"{__version__} (installed metadata: {installed})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeflow", description="Exact, fast Mixture-of-Experts layers for LLM inference.")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors (accepted anywhere on the line)")
    p.add_argument("--version", action="version", version=f"moeflow {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run a tiny MoE model end to end and check it against transformers")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    d.add_argument("--tokens", type=int, default=None,
                   help="tokens to generate, within the model's context (default 32; 12 per rank with --ep)")
    d.add_argument("--ep", type=int, default=None,
                   help="expert parallel over N >= 1 ranks (launch with torchrun --nproc-per-node N)")
    d.set_defaults(func=_cmd_demo)

    i = sub.add_parser("info", help="describe a checkpoint directory (config.json + safetensors), no weights loaded")
    i.add_argument("path")
    i.add_argument("--slots", type=int, default=None, help="size an offload cache of this many expert slots")
    i.add_argument("--kernels", action="store_true",
                   help="also print the kernel plan (every kernel, tile and path) per T for one MoE layer")
    i.add_argument("--device", default=None,
                   help="with --kernels: plan for this device (cuda, h100, h200, a100, cpu; default: the GPU here, "
                        "else h100); with --gpu-budget: whose HBM / PCIe bandwidth (h100, h200, a100; default h100)")
    i.add_argument("--batch-invariant", action="store_true", help="with --kernels: the batch-invariant mode's plan")
    i.add_argument("--gpu-budget", default=None,
                   help="predict GPU memory resident vs offloaded at this budget (e.g. 60GiB; default with --json: "
                        "the --device's memory) and the decode floor per token")
    i.add_argument("--reserve", default=None,
                   help="with --gpu-budget: the KV cache / activation / workspace allowance (default 4GiB)")
    i.add_argument("--json", action="store_true", help="print the prediction as JSON (moeflow.predict's fields)")
    i.set_defaults(func=_cmd_info)

    r = sub.add_parser("route", help="run a checkpoint on a prompt and show which experts each token chose")
    r.add_argument("path")
    r.add_argument("--prompt", required=True)
    r.add_argument("--max-tokens", type=int, default=None,
                   help="route only the prompt's first N tokens (default: all of it, up to the model's context)")
    r.set_defaults(func=_cmd_route)

    b = sub.add_parser("bench", add_help=False,
                       help="run a benchmark script (table + JSON); extra args go to the script",
                       description="Run a benchmark script from a checkout's benchmarks/ folder; the arguments "
                                   "after WHICH go to the script (`moeflow bench WHICH --help` lists them).")
    b.add_argument("-h", "--help", action="store_true",
                   help="show this help (after WHICH: the benchmark script's own options)")
    b.add_argument("which", nargs="?", choices=sorted(_BENCH_MODULES))
    b.add_argument("--plot", action="store_true", help="also write PNG plots (beside each JSON the script wrote)")
    b.add_argument("--force", action="store_true", help="with --plot: replace a PNG that moeflow did not write")
    b.set_defaults(func=_cmd_bench, takes_rest=True, parser=b)

    add_trace_parser(sub)
    return p


def _split_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Remove `--debug` wherever it sits (before "--"): the flag means the same at any position."""
    end = argv.index("--") if "--" in argv else len(argv)
    head = [a for a in argv[:end] if a != "--debug"]
    return head + argv[end:], len(head) != end


def main(argv: Sequence[str] | None = None) -> int:
    argv, debug = _split_debug(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    command = " ".join(x for x in (args.command, getattr(args, "action", None)) if x)
    try:
        if getattr(args, "takes_rest", False):
            return args.func(args, rest)
        return args.func(args)
    except (UserError, *_USER_ERRORS) as exc:
        if debug:
            raise
        hint = getattr(exc, "hint", "") or _hint_for(exc)
        print(f"moeflow {command}: error: {_one_line(exc)}" + (f"; hint: {_one_line(hint)}" if hint else ""),
              file=sys.stderr)
        return 2


def _one_line(exc: BaseException | str) -> str:
    """The message on one line (transformers' and safetensors' messages can span several)."""
    text = str(exc) if str(exc) else type(exc).__name__
    return " ".join(text.split())


def _hint_for(exc: BaseException) -> str:
    """What to do, where the message alone does not say it; "" when it does."""
    from .paths import PathError

    if isinstance(exc, PathError):  # names the option, the path and what to do
        return ""
    text = str(exc)
    if "config.json" in text or "safetensors" in text or "pytorch_model.bin" in text:
        return "point PATH at a Hugging Face checkpoint directory (it holds config.json and *.safetensors)"
    if "not a supported MoE family" in text:
        return "moeflow handles the MoE families listed above; dense models need no moeflow"
    if re.search(r"CUDA is not available|needs CUDA|requires CUDA|needs a CUDA", text):
        return "this option needs a GPU; drop it or run on a machine with CUDA"
    if "trace header" in text:
        return "record a trace with `moeflow trace record MODEL_DIR --out t.jsonl`, then pass that file"
    return ""


if __name__ == "__main__":
    raise SystemExit(main())
