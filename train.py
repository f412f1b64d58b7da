"""jaxtrain's command line: `python train.py --config configs/tiny.py [--train.steps=20 ...]`."""
from jaxtrain import preemption

preemption.catch_early()  # before anything slow: a SIGTERM while starting stops it cleanly

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from jaxtrain import cli  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="a recipe file in configs/")
    parser.add_argument("--inspect-sharding", action="store_true",
                        help="print where every parameter lives on the mesh, then exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="compile the train step from abstract parameters on the present "
                             "devices (the layout scaled to fit them), print compiled memory and "
                             "collectives next to the ledger's prediction, then exit")
    parser.add_argument("--gpu", default=None,
                        help="the GPU the ledger plans for: h100 (default), h200, a100, cpu")
    parser.add_argument("--target", default=None,
                        help="with --dry-run: compile for N compile-only GPUs of this kind (h100, "
                             "h200) with the real XLA:GPU compiler; needs the gpu-compile extra")
    parser.add_argument("--json", action="store_true",
                        help="with --dry-run: print the report as JSON (for scripts)")
    parser.add_argument("--devices", type=int, default=None,
                        help="plan the configured layout for N devices (resolves its -1 fill); "
                             "default: the fewest on which it fits --gpu per the ledger")
    args, overrides = parser.parse_known_args(argv)
    if args.target:  # compile-only GPUs need the CPU backend, chosen before jax starts
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return cli.run(args.config, overrides, inspect_sharding=args.inspect_sharding,
                   dry_run=args.dry_run, gpu=args.gpu, devices=args.devices,
                   target=args.target, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
