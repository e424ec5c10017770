"""Token ids of seeded random conversations (one to three turns, each a Continue with the answer before it, thinking
on or off, a system prompt or none, text with special-token strings, emoji, CJK, combining marks, control
characters and long runs) against the real chat template rendered by transformers and its tokenizer.json
(../shared/qwen35-tokenizer; skipped where it is absent). With allow_special_tokens the ids are the template's
exactly; without, the user's text stays text, so only conversations that write no added token are compared."""
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

REAL_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "qwen35-tokenizer"
pytestmark = pytest.mark.skipif(not (REAL_TOKENIZER / "tokenizer.json").is_file(),
                                reason="../shared/qwen35-tokenizer is absent")

SPECIALS = ["<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|endoftext|>",
            "<image>", "<video>", "<|fim_pad|>"]
ATOMS = ["hello", " world", "The", "it's", "'S", "1234", "３", "😀", "👩\u200d👩\u200d👧", "中文", "提问：", "e\u0301",
         "\u0301", "\u0338", "नमस्ते", "\r\n", "\n", "\n\n", "\r", " ", "  ", "\t", "\x00", "\x0b", "\x1c", "\x85",
         "\xa0", "\u2028", "\u3000", "\u200b", "\ufeff", ".", "!!", "```", "<", ">", "|", "ﬁ", "가", "\u1100\u1161",
         "x" * 50, "ab " * 20, "word " * 700, "assistant", "user\n", "system"]


@pytest.fixture(scope="module")
def oracle():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(REAL_TOKENIZER))

    def ids(messages, thinking):
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        return hf.encode(text, add_special_tokens=False)
    return ids


@pytest.fixture(scope="module")
def model():
    from qwen35_fast.runtime.tokenizer import load_tokenizer
    return SimpleNamespace(tokenizer=load_tokenizer(REAL_TOKENIZER))  # all the prompt builders read of a model


def _text(r: random.Random, specials: bool, most: int = 8) -> str:
    pool = ATOMS + (SPECIALS if specials else [])
    return "".join(r.choice(pool) for _ in range(r.randint(0, most)))


def _conversation(r: random.Random):
    """(system prompt, [(user text, the answer after it or None)], thinking flag of each turn)"""
    turns = []
    n = r.randint(1, 3)
    for k in range(n):
        user = _text(r, True)
        user = user if user.strip() else user + "q"  # (an empty message is refused, not rendered)
        answer = None
        if k < n - 1:
            answer = _text(r, True)
            if r.random() < 0.4:  # an answer that thought: the template drops its block from the history
                answer = f"{_text(r, False, 3)}<think>{_text(r, False, 3)}</think>{_text(r, False, 4)}"
        turns.append((user, answer))
    return _text(r, True) if r.random() < 0.6 else "", turns, [r.random() < 0.5 for _ in turns]


def _ours(model, system, turns, thinking, special):
    """The ids the Text Prefill and a chain of Continue nodes give: each Continue drops its parent's generation
    prompt and appends the answer as the assistant turn and the next user turn."""
    from qwen35_fast.runtime.conversation import follow_up_ids
    from qwen35_fast.runtime.generate import encode_prompt, generation_prompt_ids
    ids = encode_prompt(model, turns[0][0], system, thinking[0], True, special)
    if len(turns) > 1:
        ids = ids[:len(ids) - len(generation_prompt_ids(model, thinking[0]))]
    for k in range(1, len(turns)):  # (end: where the turn's generation prompt starts)
        new, _, _, end = follow_up_ids(model, turns[k][0], [], 0, turns[k - 1][1], thinking[k], special)
        ids = ids + (new if k == len(turns) - 1 else new[:end])
    return ids


def _messages(system, turns):
    messages = [{"role": "system", "content": system}] if system.strip() else []
    for user, answer in turns:
        messages.append({"role": "user", "content": user})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    return messages


@pytest.mark.parametrize("seed", range(4))
def test_conversations_give_the_templates_ids(model, oracle, seed):
    r = random.Random(seed)
    added = list(model.tokenizer.added_tokens)
    compared = 0
    for _ in range(150):
        system, turns, thinking = _conversation(r)
        special = r.random() < 0.5
        everything = system + "".join(u + (a or "") for u, a in turns)
        if not special and any(t in everything for t in added):
            continue  # (plain: the template would make those strings tokens, ours keeps them text)
        want = oracle(_messages(system, turns), thinking[-1])
        got = _ours(model, system, turns, thinking, special)
        assert got == want, (system, turns, thinking, special)
        compared += 1
    assert compared > 60
