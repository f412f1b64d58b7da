"""`python -m jaxtrain.data prepare --input PATHS_OR_GLOBS --tokenizer TOKENIZER --out DIR`

Tokenizes jsonl (the --text-field of each line), parquet (that column) and .txt files (one
document each) in worker processes into token shards for data.source=prepared. Re-running the
same command resumes an interrupted prepare. Errors print one line and exit 2.
"""
import argparse
import sys

from jaxtrain.config import ConfigError, PrepareConfig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize documents into shards")
    defaults = PrepareConfig()
    p.add_argument("--input", nargs="+", action="extend", required=True, dest="inputs",
                   help="files, folders or globs (quote them) of .jsonl, .parquet and .txt")
    p.add_argument("--tokenizer", default=defaults.tokenizer,
                   help="'byte' or a Hugging Face tokenizer.json (or its folder)")
    p.add_argument("--out", required=True, help="the prepared directory (data.path)")
    p.add_argument("--text-field", default=defaults.text_field,
                   help="the jsonl key / parquet column holding the text (default: text)")
    p.add_argument("--workers", type=int, default=defaults.workers,
                   help="tokenizing processes (default 0: one per CPU)")
    p.add_argument("--shard-bytes", type=int, default=defaults.shard_bytes,
                   help=f"input text per shard (default {defaults.shard_bytes})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    from jaxtrain.data.prepare import prepare
    pcfg = PrepareConfig(inputs=tuple(args.inputs), tokenizer=args.tokenizer, out=args.out,
                         text_field=args.text_field, workers=args.workers,
                         shard_bytes=args.shard_bytes)
    try:
        prepare(pcfg, echo=lambda s: print(s, file=sys.stderr), progress=not args.no_progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
