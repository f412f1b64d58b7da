"""Data: tokenizers, document sources, prepared token shards, mixtures, packing into windows
with segment ids, and a resumable grain iterator of global batches.

    tokenizer.py  bytes or a Hugging Face tokenizer.json; how a document becomes tokens
    documents.py  the in-memory sources (corpus, text, tokens) and the train/eval split
    readers.py    raw jsonl / parquet / txt inputs for prepare, cut into pieces
    prepare.py    `python -m jaxtrain.data prepare`: pieces -> atomically written shards
    prepared.py   a prepared directory at train time: checks, memory-mapped shards
    mixture.py    Megatron's blend: the component of every sequence of a run
    packing.py    a split's documents as one stream read in windows
    loader.py     components -> grain -> this process's rows of each global batch
"""
from jaxtrain.data.documents import (Documents, corpus_texts, open_token_file, split_mask,
                                     text_documents)
from jaxtrain.data.errors import DataError
from jaxtrain.data.loader import (BatchIterator, load_documents, load_split, load_splits,
                                  make_batches, synthetic_batch)
from jaxtrain.data.packing import PackedStream
from jaxtrain.data.tokenizer import (ByteTokenizer, HFTokenizer, Tokenizer, check_vocab,
                                     make_tokenizer, tokenizer_from_spec)

__all__ = ["BatchIterator", "ByteTokenizer", "DataError", "Documents", "HFTokenizer",
           "PackedStream", "Tokenizer", "check_vocab", "corpus_texts", "load_documents",
           "load_split", "load_splits", "make_batches", "make_tokenizer", "open_token_file",
           "split_mask", "synthetic_batch", "text_documents", "tokenizer_from_spec"]
