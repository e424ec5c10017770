"""PyTorch reference of sample.cu: one token drawn from fp32 logits, and the candidates it was drawn from.

The repetition and presence penalties read marks (uint8 [V], one a vocabulary id): bit 0 an id of the prompt or
the answer so far, bit 1 an id of the answer; the pick marks the id it draws with both bits.

Candidates are ordered by logit, the lower id first where logits tie (the order of order_keys): top_k keeps
exactly k of them whatever ties at the k-th. The draw is the inverse of the kept weights' running sum at
u * their total, u in [0, 1) given by the caller: the first candidate whose running sum exceeds it. No op
here reads a value back to the host, so a decode loop can queue its next step behind the pick."""
from __future__ import annotations

import torch

_LOW = 0xFFFFFFFF


def penalty_marks(prompt_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """uint8 [vocab] marks of a generation's start: bit 0 on every id of the prompt (int64 ids on the device)."""
    marks = torch.zeros(vocab, dtype=torch.uint8, device=prompt_ids.device)
    return marks.index_fill_(0, prompt_ids, 1)


def penalise_ref(logits: torch.Tensor, marks: torch.Tensor, repetition: float, presence: float) -> torch.Tensor:
    """fp32 logits [V] with the penalties: an id with bit 0 divided by `repetition` where its logit is positive,
    multiplied where not; then `presence` subtracted from an id with bit 1. On a GPU as selects over the
    vocabulary (nothing read back: a decode loop queues its next step behind the pick); on the CPU on the marked
    ids alone (the same values)."""
    return (_penalise_selects if logits.is_cuda else _penalise_marked)(logits, marks, repetition, presence)


def _penalise_selects(logits, marks, repetition, presence):
    seen, answered = (marks & 1).bool(), (marks & 2).bool()
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return torch.where(answered, logits - presence, logits)


def _penalise_marked(logits, marks, repetition, presence):
    marked = marks.nonzero().squeeze(1)
    bits = marks[marked]
    seen, answered = marked[(bits & 1).bool()], marked[(bits & 2).bool()]
    out = logits.clone()
    x = out[seen]
    out[seen] = torch.where(x > 0, x / repetition, x * repetition)
    out[answered] = out[answered] - presence
    return out


def order_keys(logits: torch.Tensor) -> torch.Tensor:
    """int64 [V] keys, unique, ordered as the candidates are: the logit's fp32 bits in signed order (negatives'
    magnitude bits flipped; a positive NaN above +inf, as torch.topk ranks it, a negative one, as inf - inf
    gives on the CPU, below -inf) in the high word, 0xFFFFFFFF - id below."""
    bits = logits.contiguous().view(torch.int32)
    hi = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ids = torch.arange(logits.numel(), dtype=torch.int64, device=logits.device)
    return (hi.to(torch.int64) << 32) | (_LOW - ids)


def top_k_ref(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ids (int64 [k]) of the k largest logits in candidate order (logit descending, then id ascending). On a
    GPU a topk over order_keys (nothing read back); on the CPU a topk over the logits, and where the k-th value
    ties with one past it, the ids tied at it taken lowest first (the same ids)."""
    return (_top_k_keys if logits.is_cuda else _top_k_values)(logits, k)


def _top_k_keys(logits, k):
    keys = torch.topk(order_keys(logits), k).values
    return _LOW - (keys & _LOW)


def _top_k_values(logits, k):
    values, ids = torch.topk(logits, min(k + 1, logits.numel()))
    if values[0].isnan():  # NaN, which topk ranks first: the keys' order of NaN
        return _top_k_keys(logits, k)
    if (values == 0).any():  # -0.0 and +0.0 are equal here and not in the keys (+0.0 first): their order
        zeros = torch.signbit(logits[logits == 0])
        if zeros.any() and not zeros.all():
            return _top_k_keys(logits, k)
    if k < logits.numel() and values[k] == values[k - 1]:  # ids tied at the k-th past the k taken: the lowest
        above = ids[:k][values[:k] > values[k - 1]]
        ids = torch.cat([above, (logits == values[k - 1]).nonzero().squeeze(1)[:k - above.numel()]])
    ids = ids[:k].sort().values
    return ids[torch.sort(logits[ids], descending=True, stable=True).indices]


def candidates_ref(logits: torch.Tensor, top_k: int, temperature: float, min_p: float,
                   top_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the draw takes: (weights [C], ids int64 [C] or None for every id in order). The weights are the
    temperature's softmax probabilities of the candidates (top_k's k, or all), zero where min_p drops one (below
    min_p times the largest) or top_p does (the probability before it, in candidate order, reaches top_p);
    not renormalised. Without top_k and top_p the vocabulary stays in id order (no sort)."""
    v = logits.numel()
    ids = None
    if 0 < top_k < v:
        ids = top_k_ref(logits, top_k)
    elif top_p < 1.0:  # the whole vocabulary in candidate order: a stable sort keeps tied ids ascending
        ids = torch.sort(logits, descending=True, stable=True).indices
    x = logits if ids is None else logits[ids]
    probs = torch.softmax(x / temperature, dim=-1)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    if top_p < 1.0:  # the first candidate always stays (nothing comes before it: a top_p of 1e-300 is above 0)
        keep = probs.cumsum(0) - probs < top_p
        keep[0] = True
        probs = probs * keep
    return probs, ids


def sum_dtype(device: torch.device) -> torch.dtype:
    """The dtype draw_ref sums weights in: fp64; fp32 on Apple's GPUs, which have no fp64."""
    return torch.float32 if device.type == "mps" else torch.float64


def draw_ref(weights: torch.Tensor, u: float) -> torch.Tensor:
    """The index (int64 [1]) where the running sum of weights [C] first exceeds u * its total, never past the last
    candidate with weight (the running sum's first maximum): in fp32, u * total rounds to the total for u above
    1 - 2**-25, which no running sum exceeds."""
    run = weights.to(sum_dtype(weights.device)).cumsum(0)
    return torch.minimum(torch.searchsorted(run, run[-1:] * u, right=True), run.argmax().view(1))


def sample_ref(logits: torch.Tensor, top_k: int, temperature: float, min_p: float, top_p: float, u: float,
               penalties: tuple[torch.Tensor, float, float] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(id int64 [1], weights, ids) for fp32 logits [V]: the candidates of candidates_ref and the one draw_ref
    takes at u; penalties: (marks, repetition, presence) applied first (penalise_ref), the drawn id marked."""
    if penalties is not None:
        logits = penalise_ref(logits, *penalties)
    weights, ids = candidates_ref(logits, top_k, temperature, min_p, top_p)
    j = draw_ref(weights, u)
    tok = j if ids is None else ids[j]
    if penalties is not None:
        penalties[0].index_fill_(0, tok, 3)
    return tok, weights, ids
