"""Prepared token shards: jsonl + parquet + txt -> shards (round trip, resume after a kill,
identical across worker counts), training on them, mixtures, and every bad input."""
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxtrain import config, data
from jaxtrain.config import ConfigError, PrepareConfig
from jaxtrain.data import mixture, prepared, shard_check
from jaxtrain.data.__main__ import main as cli_main
from jaxtrain.data.prepare import prepare
from util import bpe_tokenizer, logged_losses

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat and dog ran far away from home über café 🙂 \n".split(" ")


def _docs(rng, n, words=WORDS, lo=3, hi=60):
    return [" ".join(rng.choice(words) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def _write_corpus(folder: pathlib.Path, docs) -> list[str]:
    """docs[0:100] a.jsonl, [100:150] b.jsonl (+ blank lines), [150:250] c.parquet (row groups of
    30), the rest one .txt each; returns the documents in prepare's order (sorted paths)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    folder.mkdir(parents=True)
    with open(folder / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:100]))
    with open(folder / "b.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n\n" for d in docs[100:150])
    pq.write_table(pa.table({"text": docs[150:250], "n": list(range(100))}),
                   folder / "c.parquet", row_group_size=30)
    for i, d in enumerate(docs[250:]):
        (folder / f"t{i:02d}.txt").write_text(d)
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = _write_corpus(root / "in", _docs(random.Random(0), 300))
    tok = bpe_tokenizer(root / "tokenizer.json", docs)
    inputs = (str(root / "in" / "*.jsonl"), str(root / "in" / "c.parquet"),
              str(root / "in" / "t*.txt"))
    return {"root": root, "docs": docs, "tokenizer": str(tok), "inputs": inputs}


def _pcfg(corpus, out, **kw):
    return PrepareConfig(**{"inputs": corpus["inputs"], "tokenizer": corpus["tokenizer"],
                            "out": str(out), "workers": 1, "shard_bytes": 3000, **kw})


@pytest.fixture(scope="module")
def prepared_dir(corpus):
    out = corpus["root"] / "prepared"
    prepare(_pcfg(corpus, out), echo=lambda s: None, progress=False)
    return out


def _files(folder):
    """What prepare wrote (verified.json, the stamps of the files it checked, aside)."""
    return {p.name: p.read_bytes() for p in sorted(pathlib.Path(folder).iterdir())
            if p.name != shard_check.VERIFIED}


def _cfg(**overrides):
    cfg = config.Config()
    cfg.train.seq_len, cfg.train.global_batch = 16, 4
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg.validate()


# ----------------------------------------------------------------------------- prepare

def test_tokens_round_trip_and_manifest(corpus, prepared_dir):
    tok = data.tokenizer_from_spec(corpus["tokenizer"])
    manifest = prepared.read_manifest(str(prepared_dir))
    assert manifest["num_documents"] == 300 and len(manifest["shards"]) > 5
    assert [pathlib.Path(s["path"]).name for s in manifest["sources"]] == (
        ["a.jsonl", "b.jsonl", "c.parquet"] + [f"t{i:02d}.txt" for i in range(50)])
    assert manifest["tokenizer"]["fingerprint"] == tok.fingerprint
    docs = prepared.prepared_documents(str(prepared_dir), tok)
    assert len(docs.tokens) == manifest["num_tokens"] == docs.lengths.sum()
    for i, text in enumerate(corpus["docs"]):
        stored = docs.tokens[np.arange(docs.starts[i], docs.starts[i] + docs.lengths[i])]
        assert stored[0] == tok.bos_id and stored[-1] == tok.eos_id
        assert stored[1:-1].tolist() == tok.encode(text)
        assert tok.decode(stored[1:-1]) == text
    assert len(np.unique(docs.unit)) == 300  # every document its own split key


def test_parallel_workers_write_the_same_shards(corpus, prepared_dir, tmp_path):
    prepare(_pcfg(corpus, tmp_path / "two", workers=2), echo=lambda s: None, progress=False)
    assert _files(tmp_path / "two") == _files(prepared_dir)


def test_killed_prepare_resumes_to_identical_shards(corpus, prepared_dir, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "jaxtrain.data", "prepare", "--input", *corpus["inputs"],
           "--tokenizer", corpus["tokenizer"], "--out", str(out), "--workers", "1",
           "--shard-bytes", "300", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stderr=subprocess.PIPE)
    try:  # kill -9 while a shard is half written (a temporary file exists), a few shards in
        while proc.poll() is None:
            names = os.listdir(out) if out.is_dir() else []
            if sum(n.endswith(".json") for n in names) >= 3 and any(n.endswith(".tmp")
                                                                    for n in names):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.0005)
        proc.wait(60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    assert not (out / "manifest.json").exists()
    with pytest.raises(data.DataError, match="its prepare did not finish"):
        prepared.read_manifest(str(out))
    committed = sum(1 for p in out.glob("shard-*.json"))
    said = []
    prepare(_pcfg(corpus, out, shard_bytes=300), echo=said.append, progress=False)
    assert f"({committed} already done)" in said[-1]
    uninterrupted = tmp_path / "straight"
    prepare(_pcfg(corpus, uninterrupted, shard_bytes=300), echo=lambda s: None, progress=False)
    assert _files(out) == _files(uninterrupted)
    prepare(_pcfg(corpus, out, shard_bytes=300), echo=said.append, progress=False)
    assert "already prepared" in said[-1]


def test_prepare_errors(corpus, tmp_path):
    def fails(match, **kw):
        with pytest.raises(data.DataError, match=match):
            prepare(_pcfg(corpus, tmp_path / "out", **kw), echo=lambda s: None, progress=False)

    fails("matches no files", inputs=(str(tmp_path / "nothing" / "*.jsonl"),))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    fails(r"bad.jsonl line 2 has no 'text' field \(it has: content\); pass --text-field",
          inputs=(str(bad),))
    fails(r"line 1 has no 'body' field", text_field="body")  # caught before any tokenizing
    fails(r"c.parquet has no column 'body' \(columns: text, n\)",
          inputs=(corpus["inputs"][1],), text_field="body")
    (tmp_path / "notes.md").write_text("x")
    fails(r"notes.md is not one of .jsonl", inputs=(str(tmp_path / "*.md"),))
    prepare(_pcfg(corpus, tmp_path / "out"), echo=lambda s: None, progress=False)
    fails("holds the output of another prepare", shard_bytes=5000)
    with pytest.raises(ConfigError, match="--workers=-1"):
        prepare(_pcfg(corpus, tmp_path / "w", workers=-1), echo=lambda s: None)


def test_cli_error_is_one_line(corpus, tmp_path, capsys):
    code = cli_main(["prepare", "--input", str(tmp_path / "*.jsonl"), "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --input") and "\n" not in err
    # Bytes that are not UTF-8 on a later line (the first is checked before the workers start)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    code = cli_main(["prepare", "--input", str(latin1), "--out", str(tmp_path / "out"),
                     "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"error: {latin1} line 2 is not UTF-8 (invalid continuation byte")


# ----------------------------------------------------------------------------- training data

def test_batches_from_a_prepared_directory(corpus, prepared_dir):
    tok = data.tokenizer_from_spec(corpus["tokenizer"])
    cfg = _cfg(data__source="prepared", data__path=str(prepared_dir),
               data__tokenizer=corpus["tokenizer"], data__eval_fraction=0.2)
    for b in [next(data.make_batches(cfg)) for _ in range(2)]:
        assert b["inputs"].shape == (4, 16) and b["inputs"].max() < tok.vocab_size
        real = b["segment_ids"] > 0
        assert np.array_equal(b["loss_mask"] == 0, (b["inputs"] == tok.eos_id) | ~real)
    # Split by documents: the two splits partition the documents, each whole.
    train, held = data.load_split(cfg, "train"), data.load_split(cfg, "eval")
    assert train.num_docs + held.num_docs == 300 and 30 < held.num_docs < 90
    assert set(train.starts.tolist()).isdisjoint(held.starts.tolist())
    next(data.make_batches(cfg, "eval"))


def test_prepared_directory_errors(corpus, prepared_dir, tmp_path):
    def fails(match, **kw):
        with pytest.raises(data.DataError, match=match):
            data.make_batches(_cfg(data__source="prepared", **kw))

    fails(r"was prepared with tokenizer .*tokenizer.json \(\d+ ids.*data.tokenizer=byte is "
          r"another \(259 ids.*set data.tokenizer=", data__path=str(prepared_dir))
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>"] + [f"w{i}" for i in range(600)])}
    big = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    big.save(str(tmp_path / "big.json"))
    prepare(_pcfg(corpus, tmp_path / "big", tokenizer=str(tmp_path / "big.json")),
            echo=lambda s: None, progress=False)
    fails(r"big.json uses 603 ids but model.vocab_size=384; set model.vocab_size=640",
          data__path=str(tmp_path / "big"), data__tokenizer=str(tmp_path / "big.json"))
    fails("not a prepared directory", data__path=str(tmp_path))
    fails("is not a directory", data__path=str(tmp_path / "missing"))
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name, raw in _files(prepared_dir).items():
        (damaged / name).write_bytes(raw[:-2] if name == "shard-00001.bin" else raw)
    fails("shard-00001.bin is .* bytes but manifest.json says", data__path=str(damaged),
          data__tokenizer=corpus["tokenizer"])


def test_shards_changed_in_place_are_refused_and_checked_cheaply(corpus, prepared_dir, tmp_path,
                                                                 monkeypatch):
    """The manifest's sha256 of every shard file is checked; a file is hashed only when its
    size or mtime differs from those of its last match (prepare records what it wrote)."""
    hashed = []
    digest = shard_check.hashlib.file_digest
    monkeypatch.setattr(shard_check.hashlib, "file_digest",
                        lambda f, name: hashed.append(pathlib.Path(f.name).name) or digest(f, name))
    cfg = _cfg(data__source="prepared", data__tokenizer=corpus["tokenizer"],
               data__path=str(tmp_path / "copy"))
    shutil.copytree(prepared_dir, tmp_path / "copy")  # mtimes kept: nothing to hash
    data.make_batches(cfg)
    files = 2 * len(prepared.read_manifest(str(prepared_dir))["shards"])
    assert hashed == [] and len(json.loads((prepared_dir / "verified.json").read_text())) == files
    shard = tmp_path / "copy" / "shard-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[:4] = bytes(b ^ 1 for b in raw[:4])
    shard.write_bytes(bytes(raw))  # same size, other tokens
    prepared._open.cache_clear()
    with pytest.raises(data.DataError, match=r"shard-00001.bin does not hold the bytes whose "
                       r"sha256 manifest.json records \(it changed after prepare\)"):
        data.make_batches(cfg)
    assert hashed == ["shard-00001.bin"]


# ----------------------------------------------------------------------------- mixtures

@pytest.fixture(scope="module")
def mix_dirs(tmp_path_factory):
    """Two byte-level prepared directories whose rows tell which one they came from."""
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, letters in (("a", "abcdefghijklm"), ("b", "nopqrstuvwxyz")):
        folder = root / f"in_{name}"
        folder.mkdir()
        rng = random.Random(name)
        with open(folder / "docs.jsonl", "w") as f:
            for _ in range(120):
                f.write(json.dumps({"text": "".join(rng.choice(letters) for _ in range(
                    rng.randint(20, 200)))}) + "\n")
        out[name] = root / name
        prepare(PrepareConfig(inputs=(str(folder),), tokenizer="byte", out=str(out[name]),
                              workers=1), echo=lambda s: None, progress=False)
    return out


def _from_a(batch):
    inputs = batch["inputs"]
    letter = inputs < 256  # not BOS, EOS or padding
    a = np.where(letter, inputs <= ord("m"), True).all(1)
    b = np.where(letter, inputs >= ord("n"), True).all(1)
    assert (a ^ b).all()  # every row from one component
    return a


def test_mixture_proportions_are_exact_and_layout_independent(mix_dirs):
    cfg = _cfg(data__source="prepared", data__mixture=f"0.3 {mix_dirs['a']} 0.7 {mix_dirs['b']}",
               data__eval_fraction=0.0, train__global_batch=100)
    it = data.make_batches(cfg)
    from_a = [int(_from_a(next(it)).sum()) for _ in range(100)]  # 10k sequences
    assert abs(sum(from_a) / 10_000 - 0.3) < 0.01
    assert from_a == [30] * 100  # exact in every batch: 100 is a multiple of the 3:7 period
    # Restart mid-run and another process count give the same next batches.
    it = data.make_batches(cfg)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(3)]
    for count in (1, 4):
        shards = []
        for p in range(count):
            shard = data.make_batches(cfg, "train", p, count)
            shard.set_state(state)
            shards.append([next(shard) for _ in range(3)])
        for step in range(3):
            for key in want[step]:
                np.testing.assert_array_equal(
                    np.concatenate([s[step][key] for s in shards]), want[step][key])
    # Another mixture is another run: refused, not silently resumed.
    other = data.make_batches(_cfg(data__source="prepared", train__global_batch=100,
                                   data__mixture=f"1 {mix_dirs['a']} 1 {mix_dirs['b']}",
                                   data__eval_fraction=0.0))
    with pytest.raises(data.DataError, match="components: saved"):
        other.set_state(state)


@pytest.mark.parametrize("weights", [("0.2", "0.5", "0.3"), ("1", "1", "1"), ("2", "0.25", "7")])
def test_blend_counts_at_every_prefix(weights):
    shares = mixture.shares(weights)
    blend, total = mixture.Blend(shares), sum(shares)
    picks = [blend[k] for k in range(3 * total + 17)]
    for c, share in enumerate(shares):
        mine = [i for comp, i in picks if comp == c]
        assert mine == list(range(len(mine)))  # each component's own stream, in order
        counts = np.cumsum([comp == c for comp, _ in picks])
        exact = np.arange(1, len(picks) + 1) * share / total
        assert np.abs(counts - exact).max() < len(shares)
        assert counts[total - 1] == share and counts[3 * total - 1] == 3 * share
    assert [blend[10 ** 12 + k] for k in range(3)] == [blend[10 ** 12 + k] for k in range(3)]


def test_mixture_config_errors(mix_dirs):
    def fails(match, mix, source="prepared"):
        with pytest.raises(ConfigError, match=match):
            _cfg(data__source=source, data__mixture=mix)

    fails("weights sum to 0", "0 /a 0 /b")
    fails(r"weight -1 of /a must be a finite number >= 0", "-1 /a 2 /b")
    fails(r"'x' \(before /a\) is not a number", "x /a")
    fails("expected weight/directory pairs", "0.3 /a 0.7")
    fails("data.mixture needs data.source=prepared", "1 /a", source="text")
    with pytest.raises(ConfigError, match="not both"):
        _cfg(data__source="prepared", data__mixture=f"1 {mix_dirs['a']}", data__path="x")
    with pytest.raises(data.DataError, match="is not a directory"):
        data.make_batches(_cfg(data__source="prepared", data__mixture=f"1 {mix_dirs['a']} 1 /nope"))
    fails("No closing quotation; close the quotes", "1 'my data")


def test_a_mixture_names_directories_with_spaces_in_quotes(mix_dirs, tmp_path):
    spaced = tmp_path / "my data, v2"
    spaced.symlink_to(mix_dirs["a"], target_is_directory=True)
    quoted = _cfg(data__source="prepared", data__mixture=f"0.3 '{spaced}' 0.7 {mix_dirs['b']}")
    plain = _cfg(data__source="prepared", data__mixture=f"0.3 {mix_dirs['a']},0.7 {mix_dirs['b']}")
    assert config.parse_mixture(quoted.data.mixture)[0] == ("0.3", str(spaced))
    a, b = next(data.make_batches(quoted)), next(data.make_batches(plain))
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


# ----------------------------------------------------------------------------- training

@pytest.mark.slow
def test_resume_mid_epoch_equals_the_uninterrupted_run_on_any_data_degree(corpus, prepared_dir,
                                                                          mix_dirs, tmp_path):
    """Prepare, then train on a mixture (the jsonl + parquet + txt corpus and another directory,
    one BPE tokenizer) at data=2 (fsdp=4) for 3 of 6 steps, resume at data=2 and at data=8:
    the same batches follow, so the losses are the uninterrupted run's (bit-exact on the same
    layout, to float summation order on the other)."""
    import shutil

    from jaxtrain import trainer
    from jaxtrain.checkpoint import Checkpointer
    from util import tiny_config
    other_dir = tmp_path / "other"
    prepare(_pcfg(corpus, other_dir, inputs=(str(mix_dirs["b"].parent / "in_b"),)),
            echo=lambda s: None, progress=False)
    common = ("--data.source=prepared", f"--data.mixture=0.3 {prepared_dir} 0.7 {other_dir}",
              f"--data.tokenizer={corpus['tokenizer']}", "--data.eval_fraction=0.1",
              "--train.steps=6", "--checkpoint.every=100", "--checkpoint.async_save=false")
    two = ("--parallel.data=2", "--parallel.fsdp=4")
    straight, stopped, moved = tmp_path / "straight", tmp_path / "stopped", tmp_path / "moved"
    trainer.train(tiny_config(*common, *two, workdir=str(straight)))
    trainer.train(tiny_config(*common, *two, "--train.exit_interval=3", workdir=str(stopped)))
    ckpt = Checkpointer(stopped / "checkpoints", tiny_config().checkpoint)
    assert ckpt.latest_step() == 3 and ckpt.manager.restore(3)["data"]["sequences"] == 24
    ckpt.close()
    shutil.copytree(stopped, moved)
    trainer.train(tiny_config(*common, *two, workdir=str(stopped)))
    trainer.train(tiny_config(*common, "--parallel.data=8", workdir=str(moved)))
    want, same, other = logged_losses(straight), logged_losses(stopped), logged_losses(moved)
    assert {5, 6} <= set(same) <= set(want) and {5, 6} <= set(other) <= set(want)
    assert [same[s] for s in sorted(same)] == [want[s] for s in sorted(same)]
    np.testing.assert_allclose([other[s] for s in sorted(other)],
                               [want[s] for s in sorted(other)], rtol=1e-5)


def test_train_py_refuses_bad_data_before_compiling(prepared_dir, capsys):
    from jaxtrain import cli
    code = cli.run(str(ROOT / "configs" / "tiny.py"),
                   ["--data.source=prepared", f"--data.path={prepared_dir}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "was prepared with tokenizer" in err
    assert "\n" not in err
