"""`import moeflow` alone makes `experts_implementation="moeflow"` work, without importing transformers itself."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CODE = """
import sys
import moeflow
assert "transformers" not in sys.modules and "torch" not in sys.modules, "import moeflow stays light"
import torch
from transformers import AutoModelForCausalLM
from moeflow.demo import EMBEDDED_MODEL
model = AutoModelForCausalLM.from_pretrained(str(EMBEDDED_MODEL), experts_implementation="moeflow", dtype=torch.float32)
eager = AutoModelForCausalLM.from_pretrained(str(EMBEDDED_MODEL), experts_implementation="eager", dtype=torch.float32)
ids = torch.tensor([[70, 71, 72, 73]])
with torch.no_grad():
    got, want = model(ids).logits, eager(ids).logits
assert "moeflow.hf.interface" in sys.modules, "the moeflow experts ran"
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_import_moeflow_registers_the_experts_implementation():
    proc = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                               "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
