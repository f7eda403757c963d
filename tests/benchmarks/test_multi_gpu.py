"""benchmarks/multi_gpu.py --quick: its smoke check on 8 simulated CPU devices runs every part (the MoE layer in
both forms and the collectives, the model's prefill through Generator on an expert mesh, the decoder slice's decode
under tensor=8), every check passes, and the table comes last. Runs in a subprocess: the device count is fixed at
start."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADER = "| metric | value | peer (same run) | ratio | device | date | command |"


def test_quick_smoke_passes_its_checks_and_prints_the_table_last():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_gpu.py"), "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout.rstrip("\n").splitlines()
    table = lines[lines.index(HEADER):]
    rows = table[2:]
    assert rows and all(row.startswith("| ") and row.endswith("--quick` |") for row in rows), table
    for part in ("all-reduce", "all-to-all", "tiny_mesh MoE layer, decode B=8, expert=8, exchanged",
                 "MoE collectives alone", "quick stand-in prefill", "quick stand-in decode step B=8, tensor=8"):
        assert any(row.startswith(f"| {part}") for row in rows), (part, table)
    assert "FAILED" not in done.stdout and "ERROR" not in done.stdout
    assert done.stdout.count("check ") == done.stdout.count(": ok\n") > 0
