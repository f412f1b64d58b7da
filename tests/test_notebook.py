"""notebooks/sharding_inspection.ipynb runs top to bottom, and --inspect-sharding prints its table."""
import os
import pathlib
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "sharding_inspection.ipynb"


def _clean_env(**extra):
    # The notebook and the CLI set their own device count: drop the one conftest put here.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(extra)
    return env


@pytest.mark.slow
def test_notebook_executes(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the kernel inherits this environment
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Raises CellExecutionError (with the cell's traceback) on the first failing cell.
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []))
    assert "8 devices: cpu" in text
    assert "total parameter bytes per device" in text
    assert "('tensor', 'data')" in text  # ZeRO-1 masters: the data axis under the tensor split
    assert "all-gather" in text and "total" in text


def test_inspect_sharding_cli():
    out = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/tiny.py", "--inspect-sharding",
         "--parallel.data=1", "--parallel.fsdp=4", "--parallel.tensor=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=_clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["path", "shape", "logical", "axes"]
    embed = next(line for line in lines if line.startswith("embed "))
    assert "vocab,embed" in embed and "P('tensor', 'fsdp')" in embed
    assert lines[-1].startswith("total parameter bytes per device")
    assert "fsdp=4" in lines[-1] and "tensor=2" in lines[-1]
