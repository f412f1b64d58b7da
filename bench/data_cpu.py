"""Data pipeline speed on this machine: prepare throughput and the loader's time per batch.

    python bench/data_cpu.py [--mb 32] [--repeats 3] [--steps 30]

1. Writes the embedded corpus (the standard library's sources) as jsonl, about --mb MB (the
   corpus repeated), trains a 32k byte-level BPE tokenizer on its first 8 MB, and times
   `prepare` with 1 and 2 worker processes: tokens/s, best of --repeats runs (each into a fresh
   directory).
2. Prepares the same documents with the byte tokenizer (what configs/tiny.py trains on), and
   times the loader: batches of configs/tiny.py's shape (16 x 128) pulled as fast as the loader
   gives them, from one prepared directory and from a 0.3/0.7 mixture of two.
3. Trains configs/tiny.py on the mixture for --steps steps: median step time.
"""
import argparse
import json
import pathlib
import statistics
import tempfile
import time

from jaxtrain import data, trainer
from jaxtrain.config import PrepareConfig, load_config
from jaxtrain.data.prepare import prepare


def write_corpus(folder: pathlib.Path, megabytes: int) -> int:
    docs = [t for _, t in data.corpus_texts(8_000_000)]
    folder.mkdir(parents=True)
    written, i = 0, 0
    with open(folder / "corpus.jsonl", "w") as f:
        while written < megabytes * 1_000_000:
            line = json.dumps({"text": docs[i % len(docs)]}) + "\n"
            f.write(line)
            written += len(line.encode())
            i += 1
    return i


def train_tokenizer(docs, path: pathlib.Path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=32_000, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


def time_prepare(inputs, tokenizer, tmp: pathlib.Path, workers: int, repeats: int) -> dict:
    best = None
    for r in range(repeats):
        out = tmp / f"prep_{tokenizer.split('/')[-1]}_{workers}_{r}"
        t0 = time.perf_counter()
        manifest = prepare(PrepareConfig(inputs=inputs, tokenizer=tokenizer, out=str(out),
                                         workers=workers, shard_bytes=1 << 22),
                           echo=lambda s: None, progress=False)
        seconds = time.perf_counter() - t0
        best = seconds if best is None else min(best, seconds)
    return {"workers": workers, "seconds": best, "tokens": manifest["num_tokens"],
            "tokens_per_s": manifest["num_tokens"] / best, "out": out}


def time_loader(cfg, batches: int, repeats: int) -> float:
    """Best of `repeats`: seconds per batch pulled back to back from a fresh iterator."""
    best = None
    for _ in range(repeats):
        it = data.make_batches(cfg)
        next(it)  # the first batch starts grain's threads
        t0 = time.perf_counter()
        for _ in range(batches):
            next(it)
        per = (time.perf_counter() - t0) / batches
        best = per if best is None else min(best, per)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        n_docs = write_corpus(tmp / "in", args.mb)
        inputs = (str(tmp / "in" / "corpus.jsonl"),)
        tok = train_tokenizer([t for _, t in data.corpus_texts(8_000_000)], tmp / "bpe.json")
        print(f"corpus: {n_docs:,} documents, {args.mb} MB jsonl")
        for workers in (1, 2):
            r = time_prepare(inputs, tok, tmp, workers, args.repeats)
            print(f"prepare, 32k BPE, {workers} worker(s): {r['tokens']:,} tokens in "
                  f"{r['seconds']:.2f} s = {r['tokens_per_s']:,.0f} tokens/s (best of "
                  f"{args.repeats})")
        byte_a = time_prepare(inputs, "byte", tmp, 2, 1)["out"]
        byte_b = tmp / "byte_b"
        prepare(PrepareConfig(inputs=(str(tmp / "in"),), tokenizer="byte", out=str(byte_b),
                              workers=2, shard_bytes=1 << 22, text_field="text"),
                echo=lambda s: None, progress=False)
        base = ["--train.eval_every=0", "--data.source=prepared", f"--train.workdir={tmp}/run",
                f"--train.steps={args.steps}", "--train.log_every=1",
                "--checkpoint.async_save=false"]
        mix = f"--data.mixture=0.3 {byte_a} 0.7 {byte_b}"
        one_cfg = load_config("configs/tiny.py", [*base, f"--data.path={byte_a}"])
        mix_cfg = load_config("configs/tiny.py", [*base, mix])
        shape = f"{one_cfg.train.global_batch}x{one_cfg.train.seq_len}"
        for name, cfg in (("one directory", one_cfg), ("0.3/0.7 mixture", mix_cfg)):
            per = time_loader(cfg, 200, args.repeats)
            print(f"loader, {name}, {shape} batches: {1e3 * per:.3f} ms/batch (best of "
                  f"{args.repeats} x 200 batches)")
        trainer.train(mix_cfg, log=lambda *_: None)
        rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        step_ms = [1e3 * r["step_time_s"] for r in rows if "step_time_s" in r]
        print(f"tiny model on the mixture, {shape} tokens/step: median "
              f"{statistics.median(step_ms):.1f} ms/step, min {min(step_ms):.1f} over "
              f"{len(step_ms)} logged steps")


if __name__ == "__main__":
    main()
