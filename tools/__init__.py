"""Diagnostics and profiler drivers for moeflow's kernels: not the product, not in its test command.

Each tool measures or profiles something the library has (a kernel, a variant, a launch option) and
chooses it through `moeflow.experts.options.KernelOptions` (tma / pdl / fast_launch / pin), never through
module globals or environment variables. Run them from the repository root (`python tools/NAME.py` or
`bash tools/NAME.sh`); their tests: `python -m pytest tools/tests`.
"""
