"""Tiny-model training throughput on this machine's CPU.

    python bench/tiny_cpu.py [--steps 60] [overrides...]

Trains configs/tiny.py for a few steps in a temporary workdir and prints the median tokens/s
over the logged intervals (the first step, which includes compilation, is excluded).
"""
import argparse
import json
import pathlib
import statistics
import tempfile

from jaxtrain import trainer
from jaxtrain.config import load_config


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    args, overrides = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("configs/tiny.py", [f"--train.steps={args.steps}", "--train.log_every=10",
                                              "--train.eval_every=0", f"--train.workdir={tmp}",
                                              "--checkpoint.async_save=false", *overrides])
        trainer.train(cfg, log=lambda *_: None)
        rows = [json.loads(x) for x in (pathlib.Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r]
    step_ms = [1e3 * r["step_time_s"] for r in rows if "step_time_s" in r]
    print(f"tiny model, {cfg.train.global_batch}x{cfg.train.seq_len} tokens/step, "
          f"{args.steps} steps: median {statistics.median(tps):,.0f} tokens/s, "
          f"{statistics.median(step_ms):.1f} ms/step; final loss {rows[-1]['loss']:.3f}")


if __name__ == "__main__":
    main()
