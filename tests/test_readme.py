"""Every command block of the README runs as written, in its order, from a fresh folder.

A new user's folder: `configs/`, `bench/` and `train.py` of this checkout, the inputs the data
commands name (a few jsonl, parquet and txt files and a BPE tokenizer.json), one CPU device (the
fake device flag is the README's own where it needs eight), XLA:CPU's default codegen. Each line
of a ```bash block runs through bash as written, except what this suite cannot do: `pip install`
(the suite runs installed), `python -m pytest` (it is this suite) and `srun` (the command it
launches runs here without it). A training command for a cluster-sized recipe runs as written
too: on one CPU it must print the ledger's plan and name the fake-device flag (exit 2);
`--dry-run` ones compile for the devices present; `--target` ones (compile-only GPUs) run in the
gpu_compile test below. A command the rules do not know fails the test: the README cannot grow
a command that CI does not run.
"""
import json
import os
import pathlib
import random
import re
import shlex
import subprocess
import sys
import time

import pytest

from util import bpe_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLUSTER_RECIPE = re.compile(r"configs/llama\w*\.py")
SKIPPED = {"pip install": "the suite runs installed", "python -m pytest": "it is this suite"}
TIMEOUT_S = 600
SUITE_CODEGEN = ("--xla_backend_optimization_level=", "--xla_llvm_disable_expensive_passes=")


def readme_commands(text: str) -> list[str]:
    """The commands of every ```bash block, continuation lines joined, shell comments and
    #SBATCH lines left out."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(line.split())
            if line and not line.startswith("#"):
                out.append(line)
    return out


def plan_of(command: str) -> list[tuple[str, str]]:
    """[(how, what to run)] for each `&&` part of a README command; how is run | plan | gpu |
    skip:<why>."""
    parts = []
    for part in (p.strip() for p in command.split("&&")):
        skip = next((why for start, why in SKIPPED.items() if part.startswith(start)), None)
        if skip:
            parts.append((f"skip:{skip}", part))
            continue
        part = part.removeprefix("srun ")
        words = shlex.split(part, comments=True)
        if "--target" in words:
            parts.append(("gpu", part))
        elif ("train.py" in words and CLUSTER_RECIPE.search(part) and "--dry-run" not in words):
            parts.append(("plan", part))
        elif words[:1] == ["python"] or words[0].startswith("XLA_FLAGS="):
            parts.append(("run", part))
        else:
            raise AssertionError(f"README command {part!r}: no rule says how CI runs it")
    return parts


def _inputs(folder: pathlib.Path) -> None:
    """What the README's data commands read: web/*.jsonl, code/ and books/*.parquet (their
    text under `content`), tok/tokenizer.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = random.Random(0)
    words = "the model reads code and books from the web every day".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) for _ in range(60)]
    for name in ("web", "code", "books", "tok"):
        (folder / name).mkdir()
    (folder / "web" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                    for d in docs[:30]))
    (folder / "code" / "b.jsonl").write_text("".join(json.dumps({"content": d}) + "\n"
                                                     for d in docs[30:45]))
    pq.write_table(pa.table({"content": docs[45:]}), folder / "books" / "c.parquet")
    bpe_tokenizer(folder / "tok" / "tokenizer.json", docs, vocab_size=300)


def _fresh_folder(tmp_path: pathlib.Path, cpu_codegen=True) -> tuple[pathlib.Path, dict]:
    """The folder and its environment; `cpu_codegen=False` keeps the suite's -O0 codegen flags
    (the compile-only GPU commands, which run no step)."""
    (tmp_path / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    (tmp_path / "train.py").symlink_to(ROOT / "train.py")
    (tmp_path / "bench").symlink_to(ROOT / "bench", target_is_directory=True)
    _inputs(tmp_path)
    # One CPU device, as on a laptop (the fake-device flag is the README's own where it needs
    # eight), and a laptop's codegen: the suite's -O0 runs the quick start's steps ~2.5x slower.
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f
                     and not (cpu_codegen and f.startswith(SUITE_CODEGEN)))  # tests/conftest.py's
    env = {**os.environ, "XLA_FLAGS": flags, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])}
    return tmp_path, env


def _run(command: str, cwd: pathlib.Path, env: dict) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    print(f"$ {command}\n-> {done.returncode} in {time.monotonic() - started:.0f} s\n"
          f"{(done.stdout + done.stderr)[-1500:]}")
    return done


def _readme_plan() -> list[tuple[str, str]]:
    return [p for c in readme_commands((ROOT / "README.md").read_text()) for p in plan_of(c)]


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path):
    folder, env = _fresh_folder(tmp_path)
    plan = _readme_plan()
    assert {how for how, _ in plan} >= {"run", "plan", "gpu"}, plan
    for how, command in plan:
        if how in ("gpu",) or how.startswith("skip:"):
            continue
        done = _run(command, folder, env)
        output = done.stdout + done.stderr
        assert "Traceback" not in output, command
        if how == "plan":  # a cluster's layout on one CPU: its plan, then a one-line error
            assert done.returncode == 2 and "ledger plan for" in done.stdout, command
            assert "XLA_FLAGS=--xla_force_host_platform_device_count=" in done.stderr, command
        else:
            assert done.returncode == 0, command
    first = (folder / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(first[-1])["step"] == 150  # the quick start trained its 150 steps
    for run in ("tiny_mb2", "tiny_pp", "tiny_profile", "imported"):
        assert (folder / "runs" / run / "metrics.jsonl").is_file(), run
    assert (folder / "runs" / "tiny_profile" / "profile" / "mfu_breakdown.json").is_file()
    assert (folder / "data" / "code" / "manifest.json").is_file()


@pytest.mark.gpu_compile
def test_readme_commands_for_compile_only_gpus_run_as_written(tmp_path):
    folder, env = _fresh_folder(tmp_path, cpu_codegen=False)
    gpu = [command for how, command in _readme_plan() if how == "gpu"]
    assert gpu
    for command in gpu:
        done = _run(command, folder, env)
        assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, command
