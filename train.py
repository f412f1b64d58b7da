"""jaxtrain's command line: `python train.py --config configs/tiny.py [--train.steps=20 ...]`."""
import argparse
import sys

from jaxtrain import cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="a recipe file in configs/")
    parser.add_argument("--inspect-sharding", action="store_true",
                        help="print where every parameter lives on the mesh, then exit")
    args, overrides = parser.parse_known_args(argv)
    return cli.run(args.config, overrides, inspect_sharding=args.inspect_sharding)


if __name__ == "__main__":
    sys.exit(main())
