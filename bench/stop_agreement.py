"""What the per-step stop agreement (jaxtrain.preemption) costs a two-process job.

    python bench/stop_agreement.py [--steps 60] [--repeats 2]

Runs the tiny recipe as two localhost processes x 4 CPU devices (gloo collectives), with the
agreement and with it replaced by a constant (no collective; unsafe, for the comparison only),
alternating, and prints the median logged step time of each. Then, in one more two-process
job, times the agreement call alone (build the flag array, dispatch the all-reduce, read the
previous one) 300 times.
"""
import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = ["--config", "configs/tiny.py", "--train.log_every=1", "--train.eval_every=0",
        "--model.num_layers=2", "--train.seq_len=64", "--parallel.data=2", "--parallel.fsdp=2",
        "--parallel.tensor=2", "--data.corpus_max_bytes=400000", "--checkpoint.every=0"]


def child(mode: str, workdir: str, steps: int) -> None:
    sys.path.insert(0, str(ROOT))
    from jaxtrain import cli, preemption
    cli.maybe_initialize_distributed()
    if mode == "call":
        import numpy as np
        agree = preemption._Agreement()
        for _ in range(20):
            agree(False)
        times = []
        for _ in range(300):
            t = time.perf_counter()
            agree(False)
            times.append(time.perf_counter() - t)
        if int(os.environ["JAX_PROCESS_ID"]) == 0:
            print(json.dumps({"call_us": float(np.median(times)) * 1e6}))
        return
    if mode == "off":
        preemption._Agreement.__call__ = lambda self, flag: False
    from jaxtrain import trainer
    from jaxtrain.config import load_config
    cfg = load_config(ARGS[1], [*ARGS[2:], f"--train.steps={steps}", f"--train.workdir={workdir}"])
    trainer.train(cfg, log=lambda *_: None)


def launch(mode: str, steps: int) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2")
    procs = [subprocess.Popen([sys.executable, __file__, "--child", mode, workdir, str(steps)],
                              env={**env, "JAX_PROCESS_ID": str(i)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for i in range(2)]
    outs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    if mode == "call":
        return outs
    rows = [json.loads(x) for x in (pathlib.Path(workdir) / "metrics.jsonl").read_text().split("\n")
            if x]
    return [r["step_time_s"] for r in rows if "step_time_s" in r]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    times = {"on": [], "off": []}
    for _ in range(args.repeats):
        for mode in ("on", "off"):
            times[mode] += launch(mode, args.steps)
    for mode, label in (("on", "with the agreement"), ("off", "without (constant)")):
        print(f"{label}: median step {1e3 * statistics.median(times[mode]):.1f} ms over "
              f"{len(times[mode])} steps")
    call = [json.loads(x) for x in launch("call", 0)[0].splitlines() if x.startswith("{")]
    print(f"one agreement call alone: median {call[0]['call_us']:.0f} us")


if __name__ == "__main__":
    main()
