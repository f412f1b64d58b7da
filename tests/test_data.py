"""Data pipeline: tokenizers, sources, packing invariants, determinism, resume, sharding, errors."""
import json

import numpy as np
import pytest

from jaxtrain import config, data
from jaxtrain.data import documents
from jaxtrain.config import padded_vocab


def make_cfg(**overrides):
    cfg = config.Config()
    cfg.train.seq_len, cfg.train.global_batch = 32, 4
    cfg.data.corpus_max_bytes = 60_000
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def reference_pack(stream_T, doc_T, S, window, pad):
    """Loop-by-loop packing of one window from a flat stream and its document index per token."""
    lo = window * S
    toks = [int(stream_T[p]) if p < len(stream_T) else pad for p in range(lo, lo + S + 1)]
    docs = [int(doc_T[p]) if p < len(stream_T) else None for p in range(lo, lo + S + 1)]
    seg, pos, mask = [], [], []
    next_seg, seen, run = 0, {}, 0
    for i in range(S):
        d = docs[i]
        if d is None:
            seg.append(0), pos.append(0)
        else:
            if d not in seen:
                next_seg += 1
                seen[d] = next_seg
                run = 0
            seg.append(seen[d]), pos.append(run)
            run += 1
        mask.append(1.0 if d is not None and docs[i + 1] == d else 0.0)
    return toks[:-1], toks[1:], seg, pos, mask


def write_folder(tmp_path, texts, name="docs"):
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    for i, t in enumerate(texts):
        (folder / f"d{i:03d}.txt").write_text(t)
    return folder


# ----------------------------------------------------------------------------- tokenizers

def test_byte_tokenizer_round_trip_and_vocab():
    tok = data.ByteTokenizer()
    text = "héllo, wörld — ∑ 🙂\n\tend"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3
    assert min(tok.bos_id, tok.eos_id, tok.pad_id) >= 256
    assert tok.vocab_size == 259 and tok.padded_vocab_size == 384
    assert padded_vocab(128, 1) == 128 and padded_vocab(129, 1) == 256
    assert [a.tolist() for a in tok.encode_batch(["ab", "é"])] == [[97, 98], [195, 169]]


def hf_tokenizer_file(tmp_path, words=("the", "cat", "sat", "on", "mat", "dog", "ran")):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(words)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def test_hf_tokenizer_json(tmp_path):
    path = hf_tokenizer_file(tmp_path)
    cfg = make_cfg(data__tokenizer=str(path))
    tok = data.make_tokenizer(cfg.data)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    assert tok.vocab_size == 11 and tok.padded_vocab_size == 128
    ids = tok.encode("the cat sat on the mat")
    assert ids == [4, 5, 6, 7, 4, 8]
    assert tok.decode(ids) == "the cat sat on the mat"
    assert tok.encode("the zebra") == [4, 0]
    # A folder holding tokenizer.json works too.
    assert data.make_tokenizer(make_cfg(data__tokenizer=str(path.parent)).data).vocab_size == 11

    # Text source through this tokenizer: BOS ... EOS per document.
    folder = write_folder(tmp_path, ["the cat sat on the mat " * 6, "the dog ran " * 9] * 4)
    cfg = make_cfg(data__source="text", data__path=str(folder), data__tokenizer=str(path),
                   data__eval_fraction=0.0, train__seq_len=8, train__global_batch=2)
    b = next(data.make_batches(cfg))
    assert b["inputs"].max() < tok.vocab_size and b["inputs"].min() >= 1
    assert np.all((b["loss_mask"] == 0) == (b["inputs"] == tok.eos_id))


def test_check_vocab():
    tok = data.ByteTokenizer()
    data.check_vocab(tok, 259)
    with pytest.raises(data.DataError, match=r"model.vocab_size=384"):
        data.check_vocab(tok, 258)
    with pytest.raises(data.DataError, match="model.vocab_size"):
        data.make_batches(make_cfg(model__vocab_size=256))


# ----------------------------------------------------------------------------- packing

def test_packing_matches_reference_and_invariants(tmp_path):
    rng = np.random.default_rng(0)
    # Documents of very different lengths (some shorter than a row, some longer).
    texts = ["".join(rng.choice(list("abcdefgh"), size=n)) for n in [3, 40, 1, 7, 90, 15, 2, 33]]
    cfg = make_cfg(data__source="text", data__path=str(write_folder(tmp_path, texts)),
                   data__eval_fraction=0.0, train__seq_len=16, train__global_batch=2)
    stream = data.load_split(cfg, "train")
    tok = data.ByteTokenizer()
    flat = np.concatenate([[tok.bos_id] + tok.encode(t) + [tok.eos_id] for t in texts])
    doc_of = np.concatenate([[i] * (len(t) + 2) for i, t in enumerate(texts)])
    assert stream.num_tokens == len(flat) and stream.num_docs == len(texts)
    assert stream.num_windows == -(-(len(flat) - 1) // 16)
    packed = stream.pack(np.arange(stream.num_windows))
    for w in range(stream.num_windows):
        ref = reference_pack(flat, doc_of, 16, w, tok.pad_id)
        for key, want in zip(("inputs", "targets", "segment_ids", "positions", "loss_mask"), ref):
            np.testing.assert_array_equal(packed[key][w], want, err_msg=f"{key} window {w}")
    # Invariants, stated directly.
    seg, pos, mask, inp = (packed[k] for k in ("segment_ids", "positions", "loss_mask", "inputs"))
    real = seg > 0
    assert np.all(seg[:, 0] == 1) and np.all(pos[:, 0] == 0)
    new_doc = np.diff(seg, axis=1) != 0
    assert np.all(pos[:, 1:][new_doc] == 0)
    assert np.all(pos[:, 1:][~new_doc & real[:, 1:]] == pos[:, :-1][~new_doc & real[:, 1:]] + 1)
    assert np.all(mask[~real] == 0)
    # The loss is masked exactly where an input ends its document (EOS) or is padding.
    assert np.array_equal(mask == 0, (inp == tok.eos_id) | ~real)
    # The last window is padded, and only it.
    assert (~real).any() and not (~real[:-1]).any()
    assert np.all(inp[~real] == tok.pad_id)


def test_corpus_batches_shapes_dtypes_and_boundaries():
    cfg = make_cfg()
    it = data.make_batches(cfg)
    tok = data.ByteTokenizer()
    for b in take(it, 5):
        assert sorted(b) == ["inputs", "loss_mask", "positions", "segment_ids", "targets"]
        for k, v in b.items():
            assert v.shape == (4, 32)
            assert v.dtype == (np.float32 if k == "loss_mask" else np.int32), k
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
        boundary = b["inputs"] == tok.eos_id
        assert np.array_equal(b["loss_mask"] == 0, boundary)
        assert np.all(b["targets"][boundary] == tok.bos_id)
        assert b["inputs"].max() < cfg.model.vocab_size


def test_corpus_is_deterministic_and_capped():
    a = data.corpus_texts(30_000)
    b = data.corpus_texts(30_000)
    assert a == b and len(a) > 1
    assert [k for k, _ in a] == sorted(k for k, _ in a)
    assert sum(len(t.encode()) for _, t in a) <= 30_000
    assert not any(part in ("site-packages", "test", "__pycache__")
                   for k, _ in a for part in k.split("/"))


# ----------------------------------------------------------------------------- iteration

def test_same_seed_same_batches_different_seed_differs():
    first = take(data.make_batches(make_cfg()), 3)
    assert_batches_equal(first, take(data.make_batches(make_cfg()), 3))
    other = take(data.make_batches(make_cfg(train__seed=1)), 3)
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(first, other))


def test_epochs_cover_all_windows_and_reshuffle(tmp_path):
    rng = np.random.default_rng(3)
    folder = write_folder(tmp_path, ["".join(rng.choice(list("abcdefghij"), 60)) for _ in range(6)])
    cfg = make_cfg(data__source="text", data__path=str(folder), data__eval_fraction=0.0,
                   train__seq_len=8, train__global_batch=1)  # batch 1: an epoch is whole batches
    stream = data.load_split(cfg, "train")
    W = stream.num_windows
    all_rows = stream.pack(np.arange(W))["inputs"]
    assert len(np.unique(all_rows, axis=0)) == W
    it = data.make_batches(cfg)
    epochs = []
    for _ in range(2):
        rows = np.concatenate([b["inputs"] for b in take(it, W)])
        order = [int(np.flatnonzero((all_rows == r).all(1))[0]) for r in rows]
        assert sorted(order) == list(range(W))  # every window once per epoch
        epochs.append(order)
    assert epochs[0] != epochs[1]


def test_resume_from_saved_state():
    cfg = make_cfg()
    it = data.make_batches(cfg)
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # what checkpoint.py would store
    expected = take(it, 4)
    fresh = data.make_batches(cfg)
    fresh.set_state(state)
    assert_batches_equal(take(fresh, 4), expected)


def test_resume_under_another_global_batch_continues_the_sequence_stream():
    """The position is counted in sequences: a global batch that divides it resumes exactly."""
    it = data.make_batches(make_cfg(train__global_batch=4))
    take(it, 3)
    state = it.get_state()
    assert state["sequences"] == 12
    want = np.concatenate([b["inputs"] for b in take(it, 3)])  # sequences 12..23
    half = data.make_batches(make_cfg(train__global_batch=2))
    half.set_state(state)
    np.testing.assert_array_equal(np.concatenate([b["inputs"] for b in take(half, 6)]), want)
    wider = data.make_batches(make_cfg(train__global_batch=6))
    wider.set_state(state)
    np.testing.assert_array_equal(np.concatenate([b["inputs"] for b in take(wider, 2)]), want)


def test_resume_rejects_other_config():
    it = data.make_batches(make_cfg())
    next(it)
    state = it.get_state()
    with pytest.raises(data.DataError, match=r"4 sequences .*train.global_batch=8"):
        data.make_batches(make_cfg(train__global_batch=8)).set_state(state)
    with pytest.raises(data.DataError, match="seed: saved 0, now 1"):
        data.make_batches(make_cfg(train__seed=1)).set_state(state)
    with pytest.raises(data.DataError, match="seq_len: saved 32, now 16"):
        data.make_batches(make_cfg(train__seq_len=16)).set_state(state)


def test_resume_from_a_version_1_state():
    """Checkpoints written before positions were counted in sequences still resume."""
    it = data.make_batches(make_cfg())
    take(it, 2)
    want = next(it)
    v1 = {"version": 1, "split": "train", "seed": 0, "global_batch": 4, "seq_len": 32,
          "num_windows": it.streams[0].num_windows, "grain": {"next_index": 2}}
    fresh = data.make_batches(make_cfg())
    fresh.set_state(v1)
    assert_batches_equal([next(fresh)], [want])


@pytest.mark.parametrize("count", [2, 4])
def test_process_shards_concatenate_to_the_global_batch(count):
    cfg = make_cfg(train__global_batch=8)
    whole = take(data.make_batches(cfg), 3)
    shards = [take(data.make_batches(cfg, "train", p, count), 3) for p in range(count)]
    for step in range(3):
        for k in whole[step]:
            got = np.concatenate([shards[p][step][k] for p in range(count)])
            np.testing.assert_array_equal(got, whole[step][k], err_msg=k)
    assert shards[0][0]["inputs"].shape == (8 // count, 32)


def test_process_resume_across_process_counts():
    cfg = make_cfg(train__global_batch=8)
    it = data.make_batches(cfg)
    take(it, 2)
    state = it.get_state()
    want = next(it)
    halves = []
    for p in range(2):
        shard = data.make_batches(cfg, "train", p, 2)
        shard.set_state(state)
        halves.append(next(shard)["inputs"])
    np.testing.assert_array_equal(np.concatenate(halves), want["inputs"])


# ----------------------------------------------------------------------------- split

def test_eval_split_is_disjoint_and_stable(tmp_path):
    texts = [f"<<doc{i:03d}>>" + "x" * 20 for i in range(40)]
    folder = write_folder(tmp_path, texts)
    cfg = make_cfg(data__source="text", data__path=str(folder), data__eval_fraction=0.2,
                   train__seq_len=16, train__global_batch=2)
    tok = data.ByteTokenizer()

    def markers(split):
        stream = data.load_split(cfg, split)
        rows = stream.pack(np.arange(stream.num_windows))["inputs"]
        # The stream is contiguous: rejoin windows (each starts where the last one's input ended).
        text = tok.decode(np.concatenate([rows[0][:1], rows[:, 1:].ravel(), rows[-1][-1:]]))
        return {t[:11] for t in texts if t[:11] in text}

    train, held = markers("train"), markers("eval")
    assert held and train and not (held & train)
    assert len(held | train) == 40
    # Membership depends only on a document's own key: adding documents moves none.
    write_folder(tmp_path, texts + [f"<<new{i:03d}>>" + "y" * 20 for i in range(30)])
    documents._documents_from_text.cache_clear()
    assert held <= markers("eval") and not (held & markers("train"))
    # The eval iterator yields only held-out documents.
    batch_text = tok.decode(next(data.make_batches(cfg, "eval"))["inputs"].ravel())
    assert not any(m in batch_text for m in train)


def test_corpus_eval_split_disjoint():
    cfg = make_cfg(data__eval_fraction=0.1)
    docs = data.load_documents(cfg)
    is_eval = data.split_mask(docs.unit, 0.1)
    assert 0 < is_eval.sum() < len(is_eval)
    train, held = data.load_split(cfg, "train"), data.load_split(cfg, "eval")
    assert set(train.starts.tolist()).isdisjoint(held.starts.tolist())
    assert train.num_docs + held.num_docs == len(is_eval)


# ----------------------------------------------------------------------------- sources

def test_single_text_file_splits_on_blank_lines(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("first doc\nline two\n\nsecond\n  \n\n\nthird doc\n")
    docs = data.text_documents(str(f))
    assert [t.strip() for _, t in docs] == ["first doc\nline two", "second", "third doc"]
    cfg = make_cfg(data__source="text", data__path=str(f), data__eval_fraction=0.0,
                   train__seq_len=4, train__global_batch=2)
    assert data.load_split(cfg, "train").num_docs == 3


def token_stream(rng, eos, n_docs=30, vocab=200):
    docs = [rng.integers(0, vocab, size=rng.integers(1, 25)) for _ in range(n_docs)]
    docs = [np.where(d == eos, 0, d) for d in docs]
    return np.concatenate([np.append(d, eos) for d in docs]), docs


@pytest.mark.parametrize("fmt", ["npy", "bin", "u32.bin", "sidecar"])
def test_token_file_sources(tmp_path, fmt):
    eos = data.ByteTokenizer.eos_id
    flat, docs = token_stream(np.random.default_rng(1), eos)
    if fmt == "npy":
        path = tmp_path / "toks.npy"
        np.save(path, flat.astype(np.int32))
    elif fmt == "bin":
        path = tmp_path / "toks.bin"
        flat.astype(np.uint16).tofile(path)
    elif fmt == "u32.bin":
        path = tmp_path / "toks.u32.bin"
        flat.astype(np.uint32).tofile(path)
    else:  # a sidecar sets the dtype and a different EOS id
        eos = 7
        flat, docs = token_stream(np.random.default_rng(1), eos)
        path = tmp_path / "toks.bin"
        flat.astype(np.uint32).tofile(path)
        (tmp_path / "toks.bin.json").write_text(json.dumps({"dtype": "uint32", "eos_id": 7}))
    cfg = make_cfg(data__source="tokens", data__path=str(path), data__eval_fraction=0.0,
                   train__seq_len=8, train__global_batch=4)
    stream = data.load_split(cfg, "train")
    assert stream.num_docs == len(docs) and stream.num_tokens == len(flat)
    packed = stream.pack(np.arange(stream.num_windows))
    doc_of = np.concatenate([[i] * (len(d) + 1) for i, d in enumerate(docs)])
    for w in (0, 3, stream.num_windows - 1):
        ref = reference_pack(flat, doc_of, 8, w, data.ByteTokenizer.pad_id)
        for key, want in zip(("inputs", "targets", "segment_ids", "positions", "loss_mask"), ref):
            np.testing.assert_array_equal(packed[key][w], want, err_msg=f"{key} window {w}")
    b = next(data.make_batches(cfg))
    assert b["inputs"].shape == (4, 8)
    real = b["segment_ids"] > 0
    assert np.array_equal(b["loss_mask"] == 0, (b["inputs"] == eos) | ~real)


def test_token_file_eval_split(tmp_path):
    flat, docs = token_stream(np.random.default_rng(2), 257, n_docs=60)
    path = tmp_path / "toks.npy"
    np.save(path, flat.astype(np.uint16))
    cfg = make_cfg(data__source="tokens", data__path=str(path), data__eval_fraction=0.25,
                   train__seq_len=4, train__global_batch=2)
    train, held = data.load_split(cfg, "train"), data.load_split(cfg, "eval")
    assert train.num_docs + held.num_docs == 60 and held.num_docs > 0
    assert set(train.starts.tolist()).isdisjoint(held.starts.tolist())
    assert train.num_tokens + held.num_tokens == len(flat)


# ----------------------------------------------------------------------------- errors

def test_errors(tmp_path):
    def fails(match, cfg, split="train", **kw):
        with pytest.raises(data.DataError, match=match):
            data.make_batches(cfg, split, **kw)

    fails("does not exist", make_cfg(data__source="text", data__path=str(tmp_path / "nope")))
    fails("needs data.path", make_cfg(data__source="tokens"))
    fails("does not exist", make_cfg(data__source="tokens", data__path=str(tmp_path / "x.npy")))
    (tmp_path / "empty").mkdir()
    fails("no .txt files", make_cfg(data__source="text", data__path=str(tmp_path / "empty")))
    write_folder(tmp_path, ["", "  "], name="blank")
    fails("is empty", make_cfg(data__source="text", data__path=str(tmp_path / "blank")))
    fails("is empty", make_cfg(data__corpus_max_bytes=0))
    fails("no such file", make_cfg(data__tokenizer=str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    fails("not a readable Hugging Face tokenizer", make_cfg(data__tokenizer=str(bad)))

    big = tmp_path / "big.npy"
    np.save(big, np.array([1, 2, 500, 257], np.int32))
    fails(r"ids in \[0, 500\] but model.vocab_size=384",
          make_cfg(data__source="tokens", data__path=str(big)))
    odd = tmp_path / "odd.u32.bin"
    odd.write_bytes(b"\x00" * 6)
    fails("not a whole number", make_cfg(data__source="tokens", data__path=str(odd)))

    tiny = write_folder(tmp_path, ["short text"], name="tiny")
    fails("fewer than one batch", make_cfg(data__source="text", data__path=str(tiny),
                                           data__eval_fraction=0.0))
    fails("eval split is empty", make_cfg(data__source="text", data__path=str(tiny)), "eval")
    fails("not divisible by the 3 processes", make_cfg(), process_index=0, process_count=3)
    fails("process_index=2", make_cfg(), process_index=2, process_count=2)
    fails("choose 'train' or 'eval'", make_cfg(), "test")
