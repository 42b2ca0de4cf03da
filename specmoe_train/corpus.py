"""The training corpus of the small model family: offline text that we did not write, split by file.

Sources (each a root directory and a glob):
- ``cpython-stdlib``: the CPython standard library's ``*.py`` files (site-packages excluded, and
  ``pydoc_data/topics.py``, which repeats the documentation text);
- ``python-doc``: the reStructuredText sources of the Python documentation that Debian's ``python3-doc``
  package installs under ``/usr/share/doc/python3.X/html/_sources``.

Every file goes to exactly one part, train / calibration / evaluation, by a hash of its source name and
relative path, so the parts never share a file. The split (files, sizes, sha256 of each file's bytes) is
recorded in ``split.json`` next to the checkpoints; `build_corpus` refuses to build from files whose hashes
differ from a recorded split. A part is one token stream: the files in sorted order, each followed by the
end-of-text token, stored as uint16 (the vocabulary is below 65536).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PARTS = ("train", "calibration", "evaluation")
SPLIT_SALT = "specmoe-family-split-v1"
MAX_FILE_BYTES = 1_000_000
EXCLUDE = ("site-packages/", "pydoc_data/topics.py")


class CorpusError(ValueError):
    """Missing sources, files that changed since the split was recorded, or an unreadable corpus."""


@dataclass(frozen=True)
class Source:
    name: str
    root: Path
    pattern: str


def default_sources() -> list[Source]:
    """The stdlib of the running interpreter's version and the installed python3-doc text, where present."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    version = stdlib.name  # e.g. python3.11
    sources = [Source("cpython-stdlib", stdlib, "**/*.py")]
    doc = Path("/usr/share/doc") / version / "html" / "_sources"
    if doc.is_dir():
        sources.append(Source("python-doc", doc, "**/*.txt"))
    return sources


def part_of(source: str, relpath: str, calibration: float = 0.05, evaluation: float = 0.05) -> str:
    """The part a file belongs to: a deterministic function of its source name and relative path."""
    digest = hashlib.sha256(f"{SPLIT_SALT}:{source}:{relpath}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    if u < evaluation:
        return "evaluation"
    if u < evaluation + calibration:
        return "calibration"
    return "train"


def list_files(sources: list[Source]) -> list[dict]:
    """Every usable file of the sources: UTF-8 text of at most MAX_FILE_BYTES, sorted by (source, path)."""
    files = []
    for source in sources:
        if not source.root.is_dir():
            raise CorpusError(f"source {source.name}: no directory {source.root}")
        for path in sorted(source.root.glob(source.pattern)):
            rel = path.relative_to(source.root).as_posix()
            if not path.is_file() or any(rel.startswith(x) or rel == x for x in EXCLUDE):
                continue
            data = path.read_bytes()
            if not data or len(data) > MAX_FILE_BYTES:
                continue
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            files.append({"source": source.name, "path": rel, "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest(), "part": part_of(source.name, rel)})
    return files


def make_split(sources: list[Source]) -> dict:
    files = list_files(sources)
    if not files:
        raise CorpusError("the sources hold no usable text files")
    return {
        "salt": SPLIT_SALT,
        "rule": "sha256(salt:source:relpath) as u in [0,1): evaluation u<0.05, calibration u<0.10, else train",
        "sources": {s.name: {"root": str(s.root), "pattern": s.pattern} for s in sources},
        "excluded": list(EXCLUDE) + [f"files over {MAX_FILE_BYTES} bytes", "files that are not UTF-8"],
        "files": files,
        "summary": {p: {"files": sum(f["part"] == p for f in files),
                        "bytes": sum(f["bytes"] for f in files if f["part"] == p)} for p in PARTS},
    }


def read_part(split: dict, part: str, roots: dict[str, Path] | None = None) -> list[str]:
    """The texts of one part, in split order, after checking each file's hash against the split."""
    recorded = {name: Path(info["root"]) for name, info in split["sources"].items()}
    unknown = sorted(set(roots or ()) - set(recorded))
    if unknown:
        raise CorpusError(f"--root names {', '.join(unknown)}, which the split does not list; its sources: "
                          f"{', '.join(sorted(recorded))}")
    roots = {**recorded, **(roots or {})}  # a source not given keeps the path the split recorded
    texts = []
    for f in split["files"]:
        if f["part"] != part:
            continue
        path = roots[f["source"]] / f["path"]
        if not path.is_file():
            raise CorpusError(f"{path} is listed in the split but missing")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise CorpusError(f"{path} differs from the file recorded in the split (sha256 mismatch)")
        texts.append(data.decode("utf-8"))
    return texts


def tokenize_part(tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """One uint16 stream: each text's tokens followed by `eos_id`. `tokenizer` is a tokenizers.Tokenizer."""
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    pieces = []
    for enc in encodings:
        pieces.append(np.asarray(enc.ids, dtype=np.uint16))
        pieces.append(np.array([eos_id], dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def build_corpus(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None,
                 split: dict | None = None, sources: list[Source] | None = None,
                 vocab_size: int = 8192, roots: dict[str, Path] | None = None) -> dict:
    """Make (or re-check) the split, train the tokenizer on the train part unless `tokenizer_dir` holds
    one, and write ``{part}.npy`` token streams, ``split.json`` and ``tokenizer/`` into `out_dir`.
    Rebuilding from a recorded `split` checks every file's hash and, where the split records them, the
    token streams' hashes (a byte-identical corpus or a CorpusError). `roots` overrides source roots."""
    from .tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if split is None:
        split = make_split(sources or default_sources())
    train_texts = read_part(split, "train", roots)
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(tokenizer_dir)
    else:
        tokenizer = train_tokenizer(train_texts, vocab_size)
    save_tokenizer(tokenizer, out / "tokenizer")
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    summary = {}
    for part in PARTS:
        texts = train_texts if part == "train" else read_part(split, part, roots)
        stream = tokenize_part(tokenizer, texts, eos_id)
        digest = hashlib.sha256(stream.tobytes()).hexdigest()
        recorded = split.get("tokens", {}).get(part, {}).get("sha256")
        if recorded and recorded != digest:
            raise CorpusError(f"the {part} token stream differs from the recorded one (another tokenizer?)")
        np.save(out / f"{part}.npy", stream)
        summary[part] = {"files": len(texts), "tokens": int(stream.size), "sha256": digest}
    split = dict(split, tokens=summary)
    (out / "split.json").write_text(json.dumps(split, indent=1, sort_keys=True))
    return split


def load_corpus(corpus_dir: str | os.PathLike, parts=PARTS) -> dict[str, np.ndarray]:
    """The token streams of a built corpus (by default all three; `parts` names fewer, e.g. a copy of the corpus
    without its training split), checked against the hashes in its split.json."""
    corpus = Path(corpus_dir)
    split_path = corpus / "split.json"
    if not split_path.is_file():
        raise CorpusError(f"no corpus at {corpus}: build it with `python scripts/train_family.py prepare`")
    split = json.loads(split_path.read_text())
    streams = {}
    for part in parts:
        if part not in PARTS:
            raise CorpusError(f"unknown corpus part {part!r}; the parts are {', '.join(PARTS)}")
        stream = np.load(corpus / f"{part}.npy")
        if hashlib.sha256(stream.tobytes()).hexdigest() != split["tokens"][part]["sha256"]:
            raise CorpusError(f"{corpus / (part + '.npy')} does not match the hash recorded in split.json")
        streams[part] = stream
    return streams


def windows(stream: np.ndarray, length: int, stride: int | None = None) -> np.ndarray:
    """Non-overlapping (or `stride`-spaced) windows [N, length] of a token stream, as int64."""
    stride = stride or length
    starts = np.arange(0, stream.size - length + 1, stride)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int64) if starts.size else \
        np.zeros((0, length), dtype=np.int64)


def spaced_windows(stream: np.ndarray, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` windows of `length` tokens at evenly spaced offsets (the first at 0, the last at the end of
    the stream): (starts [count], rows [count, length] int64)."""
    starts = np.linspace(0, stream.size - length, count).astype(np.int64)
    return starts, np.stack([stream[s:s + length] for s in starts]).astype(np.int64)


def spread_windows(stream: np.ndarray, length: int, count: int) -> np.ndarray:
    """`count` of the non-overlapping windows of `windows`, evenly spread over the stream (all if fewer)."""
    rows = windows(stream, length)
    return rows[np.linspace(0, rows.shape[0] - 1, min(count, rows.shape[0])).astype(np.int64)]


class BatchSampler:
    """Seeded training batches [B, S+1]: each epoch visits every window start (stride S) once, in a
    permutation drawn from numpy's PCG64 with seed (seed, epoch); a window is S+1 tokens (inputs and the
    shifted labels)."""

    def __init__(self, stream: np.ndarray, batch_size: int, seq_len: int, seed: int):
        if stream.size < seq_len + 2:
            raise CorpusError(f"a stream of {stream.size} tokens is too short for windows of {seq_len + 1}")
        self.stream, self.batch_size, self.seq_len, self.seed = stream, batch_size, seq_len, seed
        self.starts = np.arange(0, stream.size - seq_len - 1, seq_len)
        self.epoch, self._order, self._pos = 0, self._permutation(0), 0

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.starts)

    def next(self) -> np.ndarray:
        rows = []
        while len(rows) < self.batch_size:
            if self._pos == self._order.size:
                self.epoch += 1
                self._order, self._pos = self._permutation(self.epoch), 0
            start = self._order[self._pos]
            self._pos += 1
            rows.append(self.stream[start:start + self.seq_len + 1])
        return np.stack(rows).astype(np.int64)
