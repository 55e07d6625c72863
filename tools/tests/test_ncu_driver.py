"""tools/ncu_kernels.py and ncu_profile.sh on the CPU: the case list and each case's KernelOptions, the
summariser on a hand-written report in ncu's text format, a few cases at tiny shapes under the Triton
interpreter, and the shell driver end to end with a stand-in `ncu` (prints a canned report, runs the case).

The tiny cases and the driver run the experts with `TritonExperts(options=...)`."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "ncu_kernels.py"
HAS_TRITON = importlib.util.find_spec("triton") is not None
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Two kernels as ncu 2025.x prints them (--print-summary none): a Triton GEMM with every section the
# driver asks for plus a --metrics row, then a C++ kernel whose name holds templates and a parameter
# list, with older unit spellings (usecond, Mbyte/s) and a section the driver does not read.
SAMPLE = """\
==PROF== Connected to process 4242 (/usr/bin/python3.12)
ncu_kernels: experts_decode_t1_qwen3 path=aligned T=1 setup 1.2s warmup 3.4s
==PROF== Profiling "moe_gate_up_kernel" - 0: 0%....50%....100% - 19 passes
==PROF== Profiling "vectorized_elementwise_kernel" - 1: 0%....50%....100% - 19 passes
==PROF== Disconnected from process 4242
[4242] python3.12@127.0.0.1
  moe_gate_up_kernel (48, 8, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    DRAM Frequency                  Ghz         2.62
    SM Frequency                    Ghz         1.98
    Elapsed Cycles                cycle       21,385
    Memory Throughput                 %        61.23
    DRAM Throughput                   %        58.10
    Duration                         us        10.82
    L1/TEX Cache Throughput           %        10.55
    L2 Cache Throughput               %        25.09
    SM Active Cycles              cycle    18,234.10
    Compute (SM) Throughput           %        11.45
    ----------------------- ----------- ------------

    OPT   This kernel grid is too small to fill the available resources on this device, resulting in only 0.4 full
          waves across all SMs. Look at Launch Statistics for more details.

    Section: Compute Workload Analysis
    -------------------- ----------- ------------
    Metric Name          Metric Unit Metric Value
    -------------------- ----------- ------------
    Executed Ipc Active   inst/cycle         0.39
    Executed Ipc Elapsed  inst/cycle         0.31
    Issue Slots Busy               %         9.85
    Issued Ipc Active     inst/cycle         0.39
    SM Busy                        %        13.12
    -------------------- ----------- ------------

    Section: Memory Workload Analysis
    ---------------------------- ----------- ------------
    Metric Name                  Metric Unit Metric Value
    ---------------------------- ----------- ------------
    Memory Throughput                Tbyte/s         2.78
    Mem Busy                               %        25.09
    Max Bandwidth                          %        61.23
    L1/TEX Hit Rate                        %         0.64
    L2 Compression Success Rate            %            0
    L2 Compression Ratio                                0
    L2 Hit Rate                            %        30.71
    Mem Pipes Busy                         %         8.42
    ---------------------------- ----------- ------------

    Section: Launch Statistics
    -------------------------------- --------------- ---------------
    Metric Name                          Metric Unit    Metric Value
    -------------------------------- --------------- ---------------
    Block Size                                                   128
    Function Cache Configuration                     CachePreferNone
    Grid Size                                                    384
    Registers Per Thread             register/thread             168
    Shared Memory Configuration Size           Kbyte          233.47
    Driver Shared Memory Per Block       Kbyte/block            1.02
    Dynamic Shared Memory Per Block      Kbyte/block           73.73
    Static Shared Memory Per Block        byte/block               0
    # SMs                                         SM             132
    Stack Size                                                 1,024
    Threads                                   thread          49,152
    Uses Green Context                                             0
    Waves Per SM                                                1.45
    -------------------------------- --------------- ---------------

    OPT   Est. Speedup: 33.33%
          A wave of thread blocks is defined as the maximum number of blocks that can be executed in parallel on the
          target GPU. The number of blocks in a wave depends on the number of multiprocessors and the theoretical
          occupancy of the kernel.

    Section: Occupancy
    ------------------------------- ----------- ------------
    Metric Name                     Metric Unit Metric Value
    ------------------------------- ----------- ------------
    Block Limit SM                        block           32
    Block Limit Registers                 block            2
    Block Limit Shared Mem                block            3
    Block Limit Warps                     block           16
    Theoretical Active Warps per SM        warp            8
    Theoretical Occupancy                     %        12.50
    Achieved Occupancy                        %        11.87
    Achieved Active Warps Per SM           warp         7.60
    ------------------------------- ----------- ------------

    OPT   Est. Local Speedup: 87.5%
          The 2.00 theoretical warps per scheduler this kernel can issue according to its occupancy are below the
          hardware maximum of 16. This kernel's theoretical occupancy (12.5%) is limited by the number of required
          registers.
    ----- --------------------------------------------------------------------------------------------------------------
    OPT   Est. Speedup: 4.2%
          A second rule after a separator line.

    Section: Warp State Statistics
    ---------------------------------------- ----------- ------------
    Metric Name                              Metric Unit Metric Value
    ---------------------------------------- ----------- ------------
    Warp Cycles Per Issued Instruction             cycle        27.42
    Warp Cycles Per Executed Instruction           cycle        27.45
    Avg. Active Threads Per Warp                                31.87
    Avg. Not Predicated Off Threads Per Warp                    29.90
    ---------------------------------------- ----------- ------------

    OPT   Est. Speedup: 48.39%
          On average, each warp of this workload spends 13.3 cycles being stalled waiting for a scoreboard dependency on
          a L1TEX (local, global, surface, texture) operation. Find the instruction producing the data being waited
          upon to identify the culprit. This stall type represents about 48.4% of the total average of 27.4 cycles
          between issuing two instructions.

    Section: Command line profiler metrics
    ---------------------------------------------------------------------- ----------- ------------
    Metric Name                                                            Metric Unit Metric Value
    ---------------------------------------------------------------------- ----------- ------------
    sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active           %        41.27
    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active           %            0
    dram__bytes_read.sum                                                          Gbyte        37.80
    dram__bytes_write.sum                                                         Mbyte       268.40
    ---------------------------------------------------------------------- ----------- ------------

  void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char *, 1>>(int, T2, T3) (16, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ------------- ------------
    Metric Name               Metric Unit Metric Value
    ----------------------- ------------- ------------
    DRAM Frequency          cycle/nsecond         2.62
    SM Frequency            cycle/nsecond         1.98
    Elapsed Cycles                  cycle        2,145
    Memory Throughput                   %         3.19
    DRAM Throughput                     %         3.19
    Duration                      usecond         1.94
    L1/TEX Cache Throughput             %         6.67
    L2 Cache Throughput                 %         1.98
    SM Active Cycles                cycle       383.65
    Compute (SM) Throughput             %         1.19
    ----------------------- ------------- ------------

    Section: GPU Speed Of Light Roofline Chart
    INF   The ratio of peak float (fp32) to double (fp64) performance on this device is 2:1.

    Section: Memory Workload Analysis
    ---------------------------- ----------- ------------
    Metric Name                  Metric Unit Metric Value
    ---------------------------- ----------- ------------
    Memory Throughput                Mbyte/s       512.00
    L2 Hit Rate                            %          n/a
    ---------------------------- ----------- ------------

    Section: Occupancy
    ------------------------------- ----------- ------------
    Metric Name                     Metric Unit Metric Value
    ------------------------------- ----------- ------------
    Theoretical Occupancy                     %          100
    Achieved Occupancy                        %         9.80
    ------------------------------- ----------- ------------

    Section: Launch Statistics
    -------------------------------- --------------- ---------------
    Metric Name                          Metric Unit    Metric Value
    -------------------------------- --------------- ---------------
    Registers Per Thread             register/thread              16
    Dynamic Shared Memory Per Block       byte/block               0
    Waves Per SM                                                0.02
    -------------------------------- --------------- ---------------
"""


def _mod():
    from tools import ncu_kernels

    return ncu_kernels


def test_list_and_names():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--list"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    names = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.strip()]
    nk = _mod()
    assert names == [c.name for c in nk.CASES]
    assert {"router_fused_t1_deepseek_v3", "router_fused_t1_qwen3", "router_2k_t8_deepseek_v3",
            "experts_decode_t1_qwen3", "experts_decode_t8_qwen3", "experts_decode_t1_gpt_oss",
            "experts_prefill_t8192_qwen3", "experts_prefill_t8192_mixtral", "experts_prefill_t2048_deepseek_v3",
            "experts_prefill_t8192_deepseek_v3", "experts_prefill_t2048_mixtral",
            "experts_prefill_t512_gpt_oss", "experts_prefill_t8192_gpt_oss", "experts_prefill_t8192_ds_v41",
            "experts_prefill_t2048_qwen3", "gmm_prefill_t8192_qwen3", "gmm_prefill_t8192_deepseek_v3",
            "experts_prefill_t8192_deepseek_v3_x1", "experts_prefill_t4096_deepseek_v3_bal",
            "experts_prefill_t8192_deepseek_v3_bal", "experts_prefill_t8192_deepseek_v3_zipf_x1",
            "experts_prefill_t8192_qwen3_zipf", "experts_prefill_t8192_deepseek_v3_zipf",
            "experts_prefill_t8192_gpt_oss_zipf", "experts_prefill_t8192_ds_v41_zipf",
            "experts_prefill_t2048_qwen3_zipf", "experts_prefill_t2048_deepseek_v3_zipf",
            "experts_prefill_t2048_gpt_oss", "experts_prefill_t2048_gpt_oss_zipf", "experts_prefill_t2048_ds_v41",
            "experts_prefill_t2048_ds_v41_zipf", "experts_decode_t1_ds_v41", "quant_mxfp4_gemv_t2_gpt_oss",
            "quant_mxfp4_gemv_t4_gpt_oss", "quant_mxfp4_gemv_t16_gpt_oss", "quant_mxfp4_gemv_t32_gpt_oss",
            "quant_mxfp4_t64_gpt_oss", "quant_mxfp4_gemv_t1_gpt_oss", "quant_mxfp4_gemv_t8_gpt_oss",
            "quant_mxfp4_prefill_t8192_gpt_oss", "quant_fp8_decode_t1_deepseek_v3",
            "quant_fp8_prefill_t8192_deepseek_v3", "quant_fp8_decode_t2_deepseek_v3",
            "quant_fp8_prefill_t8192_qwen3", "quant_nvfp4_gemv_t1_deepseek_v3", "quant_nvfp4_t64_deepseek_v3",
            "quant_nvfp4_gemv_t2_deepseek_v3", "quant_nvfp4_gemv_t8_deepseek_v3", "quant_nvfp4_gemv_t16_deepseek_v3",
            "experts_prefill_t8192_mixtral_zipf", "experts_prefill_t2048_mixtral_zipf",
            "experts_prefill_t8192_mixtral_zipf_gx", "experts_prefill_t2048_mixtral_gx",
            "quant_nvfp4_gemv_t4_deepseek_v3", "quant_fp8_prefill_t8192_qwen3_235b",
            "quant_fp8tri_prefill_t8192_qwen3_235b"} == set(names)
    # a case that forces a variant names it as KernelOptions.pin; the rest run the plan's own choice
    pinned = {c.name: dict(c.pin) for c in nk.CASES if c.pin}
    assert pinned == {"experts_prefill_t8192_mixtral_zipf_gx": {"gate_up": "tma_gather_x"},
                      "experts_prefill_t2048_mixtral_gx": {"gate_up": "tma_gather_x"},
                      "quant_fp8tri_prefill_t8192_qwen3_235b": {"gate_up": "fp8_tma"}}
    opts = nk.CASE_BY_NAME["experts_prefill_t2048_mixtral_gx"].options(tiny=False, pdl=False)
    assert opts.pdl is False and opts.tma is None and opts.pinned("gate_up") == "tma_gather_x"
    assert nk.CASE_BY_NAME["experts_prefill_t2048_mixtral_gx"].options(tiny=True).tma is True
    assert nk.CASE_BY_NAME["experts_decode_t1_qwen3"].options(tiny=True).tma is None
    out = subprocess.run([sys.executable, str(SCRIPT), "--names"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60).stdout.split()
    assert out == names
    bad = subprocess.run([sys.executable, str(SCRIPT), "no_such_case"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "unknown case" in bad.stderr


def test_parse_sample():
    nk = _mod()
    ks = nk.parse_ncu_text(SAMPLE)
    assert [k["name"].split("(")[0].strip()[:18] for k in ks] == ["moe_gate_up_kernel", "void at::native::v"]
    assert ks[0]["grid"] == "48, 8, 1" and ks[1]["block"] == "128, 1, 1"
    sol = ks[0]["sections"]["GPU Speed Of Light Throughput"]
    assert sol["Duration"] == ("us", "10.82") and sol["Elapsed Cycles"] == ("cycle", "21,385")
    ls = ks[0]["sections"]["Launch Statistics"]
    assert ls["Block Size"] == ("", "128") and ls["# SMs"] == ("SM", "132")
    assert ls["Function Cache Configuration"] == ("", "CachePreferNone")
    assert ks[0]["sections"]["Memory Workload Analysis"]["L2 Compression Ratio"] == ("", "0")
    # rule text is not read as table rows, across a separator line too
    occ = ks[0]["sections"]["Occupancy"]
    assert set(occ) == {"Block Limit SM", "Block Limit Registers", "Block Limit Shared Mem", "Block Limit Warps",
                        "Theoretical Active Warps per SM", "Theoretical Occupancy", "Achieved Occupancy",
                        "Achieved Active Warps Per SM"}
    assert len(ks[0]["rules"]["Occupancy"]) == 2

    spills = {"moe_gate_up_kernel": 24}
    r0, r1 = (nk.kernel_row("c", k, spills) for k in ks)
    assert r0["kernel"] == "moe_gate_up_kernel" and r0["grid"] == "48,8,1" and r0["block"] == "128"
    assert r0["duration_us"] == pytest.approx(10.82)
    assert (r0["dram_pct"], r0["mem_pct"], r0["sm_pct"]) == (58.10, 61.23, 11.45)
    assert r0["tensor_pct"] == pytest.approx(41.27)
    assert r0["dram_GBps"] == pytest.approx(2780.0)
    assert r0["dram_read_GB"] == pytest.approx(37.8) and r0["dram_write_GB"] == pytest.approx(0.2684)
    assert r0["l2_hit_pct"] == 30.71 and r0["occ_achieved_pct"] == 11.87 and r0["occ_theoretical_pct"] == 12.5
    assert r0["regs"] == 168 and r0["waves"] == 1.45 and r0["spills"] == 24
    assert r0["smem_KB"] == pytest.approx(73.73)
    assert r0["top_stall"].startswith("a scoreboard dependency on a L1TEX") and "13.3 cyc, 48.4%" in r0["top_stall"]
    assert r0["limiter"] == "DRAM"
    assert r1["kernel"] == "vectorized_elementwise_kernel" and r1["limiter"] == "latency: 0.02 waves"
    assert r1["duration_us"] == pytest.approx(1.94) and r1["dram_GBps"] == pytest.approx(0.512)
    assert r1["l2_hit_pct"] is None and r1["tensor_pct"] is None and r1["spills"] is None
    assert r1["dram_read_GB"] is None and r1["dram_write_GB"] is None
    assert r1["smem_KB"] == 0 and r1["regs"] == 16 and r1["top_stall"] == ""


def test_summarize_writes_markdown(tmp_path, capsys):
    nk = _mod()
    (tmp_path / "ncu_experts_decode_t1_qwen3.txt").write_text(SAMPLE)
    (tmp_path / "ncu_router_fused_t1_qwen3.txt").write_text("==ERROR== ERR_NVGPUCTRPERM - no permission\n")
    (tmp_path / "ncu_version.txt").write_text("Version 2025.3.1.0 (build 1) (public-release)")
    (tmp_path / "info_experts_decode_t1_qwen3.json").write_text(json.dumps(dict(
        shape="qwen3-30b-a3b", T=1, path="aligned", bytes=29_000_000, flops=75_000_000, time_us=40.5,
        tiles={"block_m": 16}, triton_kernels=[dict(name="moe_gate_up_kernel", n_regs=168, n_spills=3)])))
    (tmp_path / "ncu_runs.tsv").write_text("case\trc\twall_s\tnote\nexperts_decode_t1_qwen3\t0\t12.5\t\n"
                                           "router_fused_t1_qwen3\t1\t3.0\tno permission\n"
                                           "router_2k_t8_deepseek_v3\t-\t0\tskipped: 225s budget spent\n")
    rows = nk.summarize(tmp_path)
    assert [r["kernel"] for r in rows] == ["moe_gate_up_kernel", "vectorized_elementwise_kernel"]
    assert rows[0]["spills"] == 3
    md = (tmp_path / "ncu_summary.md").read_text()
    assert md == capsys.readouterr().out.rstrip("\n") + "\n"
    assert "2025.3.1.0" in md
    lines = md.splitlines()
    case_lines = [ln for ln in lines if ln.startswith("- **")]
    assert [ln.split("**")[1] for ln in case_lines] == [
        "experts_decode_t1_qwen3", "router_fused_t1_qwen3", "router_2k_t8_deepseek_v3"]
    assert "sum of ncu durations 12.8 us" in case_lines[0] and "un-profiled forward 40.5 us" in case_lines[0]
    assert "ERR_NVGPUCTRPERM" in case_lines[1] and "skipped" in case_lines[2]
    table = [ln for ln in lines if ln.startswith("| ")]
    assert table[0].startswith("| case | kernel | grid | block | duration_us | limiter | dram_pct")
    assert table[1].startswith("| experts_decode_t1_qwen3 | moe_gate_up_kernel | 48,8,1 | 128 | 10.8 | DRAM | 58.1 |")
    assert len(table) == 3


def test_limiter():
    nk = _mod()
    row = dict(dram_pct=20.0, mem_pct=35.0, sm_pct=85.0, tensor_pct=71.0)
    assert nk.limiter(row) == "compute (tensor 71%)"
    assert nk.limiter(dict(row, sm_pct=30.0, mem_pct=80.0)) == "L1/L2"
    assert nk.limiter(dict(dram_pct=45.0, mem_pct=45.0, sm_pct=10.0)) == "mixed (no unit >= 60%)"
    assert nk.limiter(dict(dram_pct=5.0, mem_pct=6.0, sm_pct=10.0, waves=3.0, occ_achieved_pct=12.0)) == \
        "latency: occupancy 12%"
    assert nk.limiter(dict(dram_pct=5.0, mem_pct=6.0, sm_pct=10.0, waves=3.0, occ_achieved_pct=50.0)) == \
        "latency: stalls"
    assert nk.limiter(dict(dram_pct=None, mem_pct=6.0, sm_pct=10.0)) == ""


def test_short_name():
    nk = _mod()
    assert nk.short_name("moe_down_kernel") == "moe_down_kernel"
    assert nk.short_name("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm>(T1::Params)") == "Kernel2"
    assert nk.short_name("at::native::(anonymous namespace)::foo<float>(int)") == "foo"


def test_compiled_triton_kernels_walks_jit_caches(monkeypatch):
    import types

    nk = _mod()

    class Meta:
        num_warps, num_stages, shared = 4, 3, 73728

    class Compiled:
        name, n_regs, n_spills, metadata = "moe_fake_kernel", 168, 2, Meta()

    class Jit:  # a JITFunction: device_caches[device] = (kernel_cache, key_cache, target, backend, binder)
        device_caches = {0: ({"key": Compiled()}, {}, None, None, None)}

    class Heuristics:  # a wrapper around it
        fn = Jit()

    mod = types.ModuleType("moeflow.kernels._ncu_fake")
    mod.kernel, mod.helper, mod.n = Heuristics(), (lambda: 0), 3
    monkeypatch.setitem(sys.modules, "moeflow.kernels._ncu_fake", mod)
    got = [k for k in nk._compiled_triton_kernels() if k["name"] == "moe_fake_kernel"]
    assert got == [dict(name="moe_fake_kernel", n_regs=168, n_spills=2, num_warps=4, num_stages=3,
                        shared_bytes=73728)]


def _interp_env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (the interpreter comes with it)")
@pytest.mark.parametrize("case", ["experts_decode_t1_qwen3", "experts_prefill_t8192_deepseek_v3_x1",
                                  "experts_prefill_t4096_deepseek_v3_bal", "experts_prefill_t2048_mixtral_gx",
                                  "gmm_prefill_t8192_qwen3", "quant_mxfp4_gemv_t1_gpt_oss", "quant_fp8_prefill_t8192_qwen3",
                                  "quant_fp8tri_prefill_t8192_qwen3_235b", "router_fused_t1_deepseek_v3"])
def test_tiny_case_runs_under_interpreter(case, tmp_path):
    info = tmp_path / "info.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", case, "--info-json", str(info)], cwd=ROOT,
                          capture_output=True, text=True, env=_interp_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"PASS {case}" in proc.stdout
    facts = json.loads(info.read_text())
    assert facts["case"] == case and facts["tiny"] is True and facts["output_finite"] is True
    assert facts["bytes"] > 0 and facts["flops"] > 0
    if case.endswith("_x1"):  # every token the same row of x: x counted once in the bytes
        assert facts["x_one_row"] is True
        assert facts["bytes"] == (facts["distinct_experts"] * 3 * facts["H"] * facts["I"]
                                  + (1 + facts["T"]) * facts["H"]) * 4  # f32 under --tiny
    if case.endswith("_bal"):  # balanced routing: every expert T * K / E rows
        assert facts["routing"] == "balanced" and facts["distinct_experts"] == facts["E"]
    if case.startswith("router_fused"):
        assert facts["fused_ran"] is True
    if case.startswith("quant_mxfp4_gemv"):
        assert facts["path"] == "gemv"
    if not case.startswith(("gmm", "router")):  # the experts' plan: what ran, with the case's options
        assert "plan_error" not in facts, facts
        pins = dict(_mod().CASE_BY_NAME[case].pin)
        assert facts["options"]["pin"] == pins
        for stage, variant in pins.items():
            assert facts["variants"][stage] == variant, facts["variants"]


def test_tiny_needs_the_interpreter():
    env = {k: v for k, v in _interp_env().items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "experts_decode_t1_qwen3"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "TRITON_INTERPRET=1" in proc.stderr


FAKE_NCU = """#!{python}
# A stand-in ncu: --version / --list-sections / --query-metrics answers, else run the app after the
# options (the arguments it was given printed first) and print a canned report.
import os, subprocess, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA (R) Nsight Compute Command Line Profiler"); print("Version 2099.1.0.0 (fake)"); sys.exit(0)
if args == ["--list-sections"]:
    print("Identifier  Display Name"); print("SpeedOfLight  GPU Speed Of Light Throughput")
    print("LaunchStats  Launch Statistics"); print("Occupancy  Occupancy"); print("WarpStateStats  Warp State")
    print("ComputeWorkloadAnalysis  Compute"); print("MemoryWorkloadAnalysis_Chart  Memory chart"); sys.exit(0)
if args == ["--query-metrics"]:
    print("sm__pipe_tensor_op_hmma_cycles_active   # of cycles where HMMA tensor pipe was active")
    print("dram__bytes_read   # of bytes read from DRAM"); sys.exit(0)
with_value = {{"--clock-control", "--target-processes", "--profile-from-start", "--section", "--print-summary", "--metrics"}}
i = 0
while i < len(args) and args[i].startswith("--"):
    i += 2 if args[i] in with_value else 1
print("FAKE-NCU-ARGS", " ".join(args[:i]), flush=True)
if "--metrics" in args[:i] and os.environ.get("FAKE_NCU_REFUSE_METRICS"):
    print("==ERROR== Failed to find metric sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
    sys.exit(1)
if os.environ.get("FAKE_NCU_HANG_WITH_PDL") and "--no-pdl" not in args[i:]:
    import time
    print("==PROF== Profiling (a kernel that never finishes)", flush=True)
    time.sleep(600)
rc = subprocess.call(args[i:])
sys.stdout.write(open({sample!r}).read())
sys.exit(rc)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (the interpreter comes with it)")
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash, timeout")
def test_profile_script_with_stand_in_ncu(tmp_path):
    sample = tmp_path / "sample.txt"
    sample.write_text(SAMPLE)
    fake = tmp_path / "bin" / "ncu"
    fake.parent.mkdir()
    fake.write_text(FAKE_NCU.format(python=sys.executable, sample=str(sample)))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "out"
    env = {**_interp_env(), "PATH": f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHON": sys.executable, "NCU_CASE_ARGS": "--tiny", "NCU_CASE_TIMEOUT": "100", "NCU_PREWARM_JOBS": "2"}
    proc = subprocess.run(["bash", "tools/ncu_profile.sh", str(out), "experts_decode_t1_qwen3", "nope"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "this ncu has no section MemoryWorkloadAnalysis: left out" in proc.stderr
    txt = (out / "ncu_experts_decode_t1_qwen3.txt").read_text()
    assert ("FAKE-NCU-ARGS --clock-control none --target-processes application-only --profile-from-start off "
            "--section SpeedOfLight "
            "--section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats "
            "--metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum "
            "--print-summary none") in txt
    assert "PASS experts_decode_t1_qwen3" in txt
    assert "ncu_kernels: experts_decode_t1_qwen3 compiled" in (out / "prewarm.log").read_text()
    runs = [ln.split("\t") for ln in (out / "ncu_runs.tsv").read_text().splitlines()]
    assert runs[0] == ["case", "rc", "wall_s", "note"]
    assert runs[1][:2] == ["experts_decode_t1_qwen3", "0"] and runs[2][:2] == ["nope", "2"]
    assert json.loads((out / "info_experts_decode_t1_qwen3.json").read_text())["case"] == "experts_decode_t1_qwen3"
    md = (out / "ncu_summary.md").read_text()
    assert "2099.1.0.0" in md and "| experts_decode_t1_qwen3 | moe_gate_up_kernel |" in md
    assert "- **nope**" in md and "command: `ncu --clock-control none" in md
    assert json.loads((out / "ncu_summary.json").read_text())[0]["kernel"] == "moe_gate_up_kernel"

    # an ncu that lists the tensor-pipe metric but refuses it: the case is profiled again without it
    out2 = tmp_path / "out2"
    env.update(FAKE_NCU_REFUSE_METRICS="1", NCU_PREWARM_JOBS="0")
    proc = subprocess.run(["bash", "tools/ncu_profile.sh", str(out2), "router_fused_t1_qwen3"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "refused --metrics" in proc.stderr
    txt = (out2 / "ncu_router_fused_t1_qwen3.txt").read_text()
    assert "--metrics" not in txt and "PASS router_fused_t1_qwen3" in txt
    assert (out2 / "ncu_runs.tsv").read_text().splitlines()[1].split("\t")[:2] == ["router_fused_t1_qwen3", "0"]

    # an ncu run that never finishes with PDL on: kept aside, the case profiled again with --no-pdl
    out3 = tmp_path / "out3"
    env.pop("FAKE_NCU_REFUSE_METRICS")
    env.update(FAKE_NCU_HANG_WITH_PDL="1", NCU_CASE_TIMEOUT="20")
    proc = subprocess.run(["bash", "tools/ncu_profile.sh", str(out3), "router_fused_t1_qwen3"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "timed out with PDL on: profiling it again with --no-pdl" in proc.stderr
    assert "never finishes" in (out3 / "pdl_timeout_router_fused_t1_qwen3.txt").read_text()
    assert "PASS router_fused_t1_qwen3" in (out3 / "ncu_router_fused_t1_qwen3.txt").read_text()
    row = (out3 / "ncu_runs.tsv").read_text().splitlines()[1].split("\t")
    assert row[:2] == ["router_fused_t1_qwen3", "0"] and row[3] == "timed out with PDL on; profiled with --no-pdl"
    assert "pdl_timeout" not in (out3 / "ncu_summary.md").read_text()  # the kept report is no case

