"""A Hugging Face `tokenizer.json` behind the interface `Tokenizer` uses of a tiktoken
Encoding (name, n_vocab, special_tokens_set, encode, encode_single_token, decode_bytes,
decode_single_token_bytes, _mergeable_ranks), so `Tokenizer` wraps it unchanged.

Each id's raw bytes come from its vocabulary string: byte-level BPE (GPT-2's "Ġ" mapping)
is decoded through the inverse of GPT-2's bytes-to-unicode table; SentencePiece-style
vocabularies map "▁" to a space and "<0xNN>" byte-fallback tokens to their byte; anything
else is its UTF-8. Special tokens keep their names as text (Tokenizer hides them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _has_type(node, name: str) -> bool:
    """Whether a tokenizer.json component (possibly a Sequence) includes type `name`."""
    if not isinstance(node, dict):
        return False
    if node.get("type") == name:
        return True
    parts = node.get("pretokenizers") or node.get("decoders") or node.get("normalizers") or []
    return any(_has_type(p, name) for p in parts)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


class HFEncoding:
    """A `tokenizers.Tokenizer` (from `folder`/tokenizer.json) shaped like a tiktoken
    Encoding. `eos_token_ids`: from generation_config.json, config.json or
    tokenizer_config.json (first found; may be empty)."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        if not folder.exists():
            raise FileNotFoundError(f"tokenizer folder {str(folder)!r} does not exist")
        if not folder.is_dir():
            raise NotADirectoryError(f"tokenizer path {str(folder)!r} is not a folder")
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {str(folder)!r} (a Hugging Face tokenizer folder "
                f"needs one; found: {sorted(p.name for p in folder.iterdir())})"
            )
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a plain Exception
            raise ValueError(f"could not load {path}: {e}") from e
        self._tok.encode_special_tokens = True  # special-token text is plain unless allowed
        self.name = folder.resolve().name or str(folder)
        spec = _read_json(path)

        vocab = self._tok.get_vocab(with_added_tokens=True)  # str -> id
        added = {a.content: (i, a.special) for i, a in self._tok.get_added_tokens_decoder().items()}
        self._special_ids = {name: i for name, (i, special) in added.items() if special}
        self.special_tokens_set = set(self._special_ids)
        self._mergeable_ranks = {s: i for s, i in vocab.items() if s not in self._special_ids}
        self.n_vocab = max(vocab.values(), default=-1) + 1

        byte_level = _has_type(spec.get("pre_tokenizer"), "ByteLevel") or _has_type(
            spec.get("decoder"), "ByteLevel"
        )
        metaspace = (
            _has_type(spec.get("pre_tokenizer"), "Metaspace")
            or _has_type(spec.get("decoder"), "Metaspace")
            or _has_type(spec.get("normalizer"), "Replace")
        )
        byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
        unbyte = {c: b for b, c in bytes_to_unicode().items()}
        self._bytes: list[bytes] = [b""] * self.n_vocab
        for s, i in vocab.items():
            if s in added:  # added tokens are stored as their literal text
                self._bytes[i] = s.encode("utf-8")
            elif byte_level and all(c in unbyte for c in s):
                self._bytes[i] = bytes(unbyte[c] for c in s)
            elif byte_fallback and (m := _BYTE_FALLBACK.fullmatch(s)):
                self._bytes[i] = bytes([int(m.group(1), 16)])
            elif metaspace:
                self._bytes[i] = s.replace("▁", " ").encode("utf-8")
            else:
                self._bytes[i] = s.encode("utf-8")
        self.eos_token_ids = self._find_eos(folder)

    def _find_eos(self, folder: Path) -> tuple[int, ...]:
        for fname in ("generation_config.json", "config.json"):
            p = folder / fname
            if p.is_file():
                eos = _read_json(p).get("eos_token_id")
                if eos is not None:
                    ids = eos if isinstance(eos, list) else [eos]
                    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                        raise ValueError(f"{p}: eos_token_id must be an int or list of ints, "
                                         f"got {eos!r}")  # fmt: skip
                    if ids:
                        return tuple(ids)
        p = folder / "tokenizer_config.json"
        if p.is_file():
            eos = _read_json(p).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                i = self._tok.token_to_id(eos)
                if i is None:
                    raise ValueError(f"{p}: eos_token {eos!r} is not in the vocabulary")
                return (i,)
        return ()

    def encode_single_token(self, text: str) -> int:
        i = self._tok.token_to_id(text)
        if i is None:
            raise KeyError(text)
        return i

    def encode(
        self, text: str, allowed_special: str | Iterable[str] = (), disallowed_special=()
    ) -> list[int]:
        """Ids of `text`; special-token names are plain text unless in `allowed_special`."""
        names = self.special_tokens_set if allowed_special == "all" else set(allowed_special)
        if not names:
            return self._encode_plain(text)
        pattern = "(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + ")"
        out: list[int] = []
        for k, part in enumerate(re.split(pattern, text)):
            if k % 2:
                out.append(self._special_ids[part])
            elif part:
                out += self._encode_plain(part)
        return out

    def _encode_plain(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode_single_token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < self.n_vocab else b""

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(map(self.decode_single_token_bytes, ids))
