"""End to end on the GPU: a Qwen3.5-9B-shaped model (random weights, bf16) with the PyTorch GDN path
and with our kernels. Checks that the logits agree within bf16 tolerance and times a 4,096-token
prefill and greedy decode for both; then, on the kernels, CUDA-graph decode over the paged K/V cache at
4K, 32K and 128K tokens of context, and what a Generate copies when it starts after a 32K-token
prefill (it forks the prefill's blocks). Writes bench/results/e2e-h200.json (or --out).

    python3 bench/e2e.py [--layers 32] [--tokens 4096] [--out PATH]
"""
import argparse
import json
import statistics
import time

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.runtime.config import FULL, LINEAR, TextConfig
from qwen35_fast.runtime.decode_graph import GraphedDecode
from qwen35_fast.runtime.model import Qwen35Model

# the text sizes of the dense Qwen3.5 checkpoints: (hidden, intermediate, layers, q heads, kv heads, GDN value heads)
SHAPES = {"0.8b": (1024, 3584, 24, 8, 2, 16), "2b": (2048, 6144, 24, 8, 2, 16), "4b": (2560, 9216, 32, 16, 4, 32),
          "9b": (4096, 12288, 32, 16, 4, 32)}


def shaped(name: str, layers: int | None = None) -> TextConfig:
    """A text config of one dense Qwen3.5 size (SHAPES; head dim 256, GDN key heads 16 of 128), `layers` deep
    (default: the checkpoint's depth)."""
    hidden, inter, depth, heads, kv, v_heads = SHAPES[name]
    layers = depth if layers is None else layers
    return TextConfig(vocab_size=248320, hidden_size=hidden, intermediate_size=inter,
                      layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)),
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=256,
                      linear_num_key_heads=16, linear_num_value_heads=v_heads, linear_key_head_dim=128,
                      linear_value_head_dim=128)


def hf_text_config(c: TextConfig, **more) -> dict:
    """transformers' Qwen3_5TextConfig arguments for text config `c` (the rotary as every released Qwen3.5 has it),
    with `more` on top."""
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_hidden_layers, layer_types=list(c.layer_types),
                num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                head_dim=c.head_dim, linear_num_key_heads=c.linear_num_key_heads,
                linear_num_value_heads=c.linear_num_value_heads, linear_key_head_dim=c.linear_key_head_dim,
                linear_value_head_dim=c.linear_value_head_dim,
                rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                     mrope_section=[11, 11, 10], mrope_interleaved=True), **more)


def nine_b(layers: int) -> TextConfig:
    return shaped("9b", layers)


@torch.no_grad()
def random_weights_(model: Qwen35Model, seed: int = 0) -> None:
    """Weights of a trained model's scale: projections N(0, 0.02), norms at their neutral value."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(1, 16, generator=g).log())
        elif name.endswith("dt_bias") or name.endswith("norm_w"):
            p.fill_(1.0)
        elif "norm" in name:
            p.zero_()
        elif name.endswith("conv_w"):
            p.normal_(0, 0.3, generator=g)
        else:
            p.normal_(0, 0.02, generator=g)


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 32768, 131072])
    ap.add_argument("--fork-tokens", type=int, default=32768)
    ap.add_argument("--out", default="bench/results/e2e-h200.json")
    a = ap.parse_args()
    model = Qwen35Model(nine_b(a.layers), torch.bfloat16, torch.device("cuda"))
    random_weights_(model)
    ids = torch.randint(0, 248000, (1, a.tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    rows, logits = [], {}
    for backend in ("torch", "cuda"):
        chosen = model.set_backend(backend)

        def run():
            cache = model.new_cache(1, a.tokens + a.decode + 3)
            return model.forward_prefill(ids, cache), cache

        ms = timed(lambda: run(), reps=3)
        lg, cache = run()
        logits[backend] = lg.float()
        step = GraphedDecode(model, cache.clone(), a.tokens + a.decode + 3)
        tok = lg.argmax(-1)
        for _ in range(2):  # warm-up: first calls pay for allocations and lazy initialisation
            tok = model.forward_decode(tok, cache).argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.decode):
            tok = model.forward_decode(tok, cache).argmax(-1)
        torch.cuda.synchronize()
        tps = a.decode / (time.perf_counter() - t0)
        row = {"backend": chosen.name, "reason": chosen.reason, "layers": a.layers, "tokens": a.tokens,
               "prefill_ms": round(ms, 2), "decode_tok_per_s": round(tps, 1)}
        # the same greedy decode replayed from a CUDA graph, as generate() runs it (either backend)
        row["decode_graph_tok_per_s"] = round(greedy_tok_per_s(step, int(lg.argmax()), a.decode), 1)
        del step
        rows.append(row)
    contexts = decode_at_contexts(model, a.contexts, a.decode)
    fork = generate_start_copy(model, a.fork_tokens)
    # bf16 tolerance: the same weights in fp32 on the PyTorch path are the reference; the kernels must
    # land as close to it as the bf16 PyTorch path does (random deep nets amplify any rounding)
    ref_model = Qwen35Model(model.config, torch.float32, torch.device("cuda"))
    with torch.no_grad():
        for p32, p16 in zip(ref_model.parameters(), model.parameters()):
            p32.copy_(p16)
    model = None  # frees the weights (run() above is done with them)
    ref_model.set_backend("torch")
    ref = ref_model.forward_prefill(ids, ref_model.new_cache(1, a.tokens)).float()
    rel = {k: float((v - ref).norm() / ref.norm()) for k, v in logits.items()}
    err = float((logits["cuda"] - logits["torch"]).norm() / logits["torch"].norm())
    top = bool(logits["cuda"].argmax() == logits["torch"].argmax())
    result = {"model": "Qwen3.5-9B-shaped, random weights, bf16", "rows": rows,
              "logits_rel_err_cuda_vs_torch": err, "same_argmax": top,
              "logits_rel_err_vs_fp32": rel, "decode_at_context": contexts, "generate_start": fork,
              "gpu": torch.cuda.get_device_name(), "host_cpu": host_cpu()}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("| GDN path | prefill %d tok (ms) | decode eager (tok/s) | decode CUDA graph (tok/s) |" % a.tokens)
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['backend']} | {r['prefill_ms']:.1f} | {r['decode_tok_per_s']:.1f} | "
              f"{r.get('decode_graph_tok_per_s', '-')} |")
    print(f"logits relative error, kernels vs PyTorch path: {err:.2e} (same argmax: {top})")
    print(f"against the fp32 model: PyTorch path (bf16) {rel['torch']:.2e}, kernels (bf16) {rel['cuda']:.2e}")
    assert rel["cuda"] <= 1.5 * rel["torch"] + 1e-3, "the kernels are further from fp32 than bf16 rounding explains"


def graphed_decode_at(model: Qwen35Model, n: int, room: int) -> tuple[GraphedDecode, int]:
    """A CUDA-graph decode step (as generate runs it) after `n` tokens of context with room for `room` more,
    and the token to feed it. The context is a 64-token prefill whose cache is then extended to n positions
    of random K/V: decode time does not depend on the values, and a real 128K prefill would only cost time."""
    store = model.kv
    ids = torch.randint(0, 248000, (1, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(n))
    cache = model.new_cache(1, 64)
    tok = int(model.forward_prefill(ids, cache).argmax())
    cache.reserve(n + room)
    blocks = torch.tensor(cache.seq.blocks[1:], device="cuda")  # block 0 holds the prefill's 64 tokens
    for pool in (store.k, store.v):
        pool[:, blocks] = torch.randn_like(pool[:, blocks]) * 0.5
    cache.length = n
    cache = cache.clone(n + room)  # as generate forks a prefill (states outside inference mode)
    return GraphedDecode(model, cache, n + room), tok


def greedy_tok_per_s(step: GraphedDecode, tok: int, steps: int) -> float:
    """Tokens a second of `steps` greedy steps of a graphed decode from `tok` (each read by the host, as
    generate reads them), after two warm-up steps."""
    for _ in range(2):
        tok = int(step(tok).argmax())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = int(step(tok).argmax())
    return steps / (time.perf_counter() - t0)


def decode_at_contexts(model: Qwen35Model, contexts, steps: int) -> list[dict]:
    """Greedy CUDA-graph decode after `n` tokens of context (graphed_decode_at), for each n."""
    model.set_backend("cuda")
    store, out = model.kv, []
    for n in contexts:
        step, tok = graphed_decode_at(model, n, steps + 1)
        tps = greedy_tok_per_s(step, tok, steps)
        kv_bytes = n * 2 * store.k[:, 0, 0].numel() * store.k.element_size()  # K and V of every attention layer
        out.append({"context": n, "decode_graph_tok_per_s": round(tps, 1), "kv_bytes_read_per_token": kv_bytes,
                    "kv_read_TBps": round(kv_bytes * tps / 1e12, 2)})
        print(f"graph decode at {n} tokens of context: {tps:.1f} tok/s")
        del step
    return out


def generate_start_copy(model: Qwen35Model, n: int) -> dict:
    """Bytes a Generate copies when it starts after an n-token prefill: the GDN states and the partly filled
    last K/V block (the prefill's other blocks are shared), against the prefill's whole K/V."""
    from qwen35_fast.runtime import generate, prefill_ids
    from qwen35_fast.runtime.memory import state_bytes
    from qwen35_fast.runtime.tokenizer import load_tokenizer
    model.tokenizer = load_tokenizer(None)
    model.set_backend("cuda")
    ids = torch.randint(0, 248000, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    pf = prefill_ids(model, ids, use_cache=False)
    before = model.kv.bytes_copied
    calls = []  # the first call may build kernels for this context's shapes: timed apart from the others
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate(model, pf, max_new_tokens=2)
        torch.cuda.synchronize()
        calls.append((time.perf_counter() - t0) * 1000)
        if not calls[1:]:
            kv = model.kv.bytes_copied - before
    whole = len(pf.cache.seq.blocks) * model.kv.k[:, 0].numel() * model.kv.k.element_size() * 2
    out = {"prefill_tokens": n, "kv_bytes_copied": kv, "gdn_state_bytes_copied": state_bytes(model),
           "prefill_kv_bytes": whole, "generate_2_tokens_ms": round(statistics.median(calls[1:]), 2),
           "generate_2_tokens_first_ms": round(calls[0], 2)}
    print(f"Generate after {n} tokens copies {kv / 2**20:.1f} MiB of K/V (of {whole / 2**20:.0f} MiB) and "
          f"{state_bytes(model) / 2**20:.1f} MiB of GDN states")
    return out


if __name__ == "__main__":
    main()
