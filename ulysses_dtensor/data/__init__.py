"""Training data: tokenizers, document sources, the prepared token store, mixtures,
packing and background loading. Nothing here downloads anything.

==================  ==========================================================
module              owns
==================  ==========================================================
``tokenizer``       byte / HF ``tokenizer.json`` tokenizers, their identity
``readers``         raw file formats (.txt, .jsonl[.gz|.zst], parquet, arrow)
``sources``         text documents by index: built-in corpus, raw files
``token_docs``      tokenized documents by index: raw text with a length
                    index, up-sampling of long documents
``store``           the prepared token store: format, memory-mapped reader
``prepare``         raw files -> store (worker processes, resumable, atomic);
                    ``python -m ulysses_dtensor.prepare_data``
``chat``            chat templates beside a tokenizer (offline), assistant spans
``sft``             ``data.format``: chat / prompt_completion renderers with
                    target flags, raw records rendered at load, format checks
``order``           each epoch's document order (seeded two-level shuffle)
``stream``          one source's endless token stream, random access by offset
``mixture``         weighted sources: which source each global row comes from
``bestfit``         best-fit decreasing rows of whole samples over a window
``loader``          packing rows (the stream cut or best fit), each dp rank
                    reading only its own rows
``prefetch``        the next batch read in a background thread
==================  ==========================================================

The token stream of a source: each document is ``[BOS] tokens [EOS]``;
documents follow each other in each epoch's order, epochs repeat forever.
Packing cuts rows of ``S`` tokens from it (see :mod:`.loader`); positions
restart at every document start and at every row start, which is how
``shard_batch`` finds documents.
"""

from .errors import DataError
from .loader import PackedLoader
from .mixture import RowMixture, SourceSpec
from .order import EpochOrder
from .prefetch import Prefetcher, StepLoader
from .readers import DATA_SUFFIXES, data_files, data_suffix
from .sources import DocumentSource, FileCorpus, StdlibCorpus, build_source
from .store import TokenStore, is_store
from .stream import TokenStream
from .token_docs import TokenDocs, TokenizedSource, Upsampled, as_token_docs
from .tokenizer import (
    TOKENIZERS_EXTRA_MSG,
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    padded_vocab_size,
    tokenizer_identity,
)

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "padded_vocab_size",
    "tokenizer_identity",
    "DocumentSource",
    "StdlibCorpus",
    "FileCorpus",
    "build_source",
    "TokenDocs",
    "TokenizedSource",
    "Upsampled",
    "as_token_docs",
    "TokenStore",
    "is_store",
    "EpochOrder",
    "TokenStream",
    "SourceSpec",
    "RowMixture",
    "PackedLoader",
    "Prefetcher",
    "StepLoader",
    "DATA_SUFFIXES",
    "DataError",
    "TOKENIZERS_EXTRA_MSG",
    "data_files",
    "data_suffix",
]
