"""bench/gpu_check.py --device cpu --quick runs every row of the GPU check on the CPU: each path
passes against its reference (the stored-format kernels fall back to the dequantizing path there, bit
for bit; the KV pool, not built yet, is skipped), printed as one table; and
asked for CUDA where there is none, it says so in one line."""

import subprocess
import sys

import pytest
import torch

from shardnet.testing.helpers import REPO_ROOT

BENCH = [sys.executable, "-m", "bench.gpu_check"]
ROWS = ["draft, CUDA graph: tiny-llama-draft", "batched block (BlockScheduler)", "quantized int8 (bf16)",
        "quantized int4 (bf16)", *(f"stored kernel: {f}" for f in ("fp8 128x128", "fp8 per-row", "gptq", "awq",
                                                                    "compressed-tensors")),
        "2-peer chain, one device", "kv pool"]


@pytest.mark.slow
def test_every_row_runs_on_the_cpu():
    r = subprocess.run([*BENCH, "--device", "cpu", "--quick"],
                       capture_output=True, text=True, timeout=300, check=False, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("device: cpu (CPU); torch "), r.stdout
    header = lines.index("| path | status | compared with | max abs logit diff | agreement | s | note |")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[header + 2:header + 2 + len(ROWS)]]
    assert [row[0] for row in rows] == ROWS, r.stdout
    for path, status, reference, diff, agreement, seconds, note in rows:
        if path == "kv pool":
            assert (status, note) == ("skipped", "kv pool: not built yet"), r.stdout
            continue
        assert status == "pass", r.stdout
        assert reference != "-" and agreement != "-" and float(diff) >= 0 and float(seconds) > 0, r.stdout
        assert "FAILED" not in note, r.stdout
    assert lines[-1].startswith(f"{len(ROWS)} rows in ") and lines[-1].endswith("10 passed, 0 failed, 1 skipped")


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a CUDA device here")
def test_cuda_without_a_device_fails_in_one_line():
    r = subprocess.run([*BENCH, "--quick"], capture_output=True, text=True, timeout=120,
                       check=False, cwd=REPO_ROOT)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1].startswith("error: no CUDA device here"), r.stderr
