"""A / B of the decode step's fused projections on the GPU: a Qwen3.5-9B-shaped model (--model: another dense
size; random weights, bf16), CUDA-graph greedy decode (as generate runs it) at each context, with the residual
adds, norms and MLP gates formed inside the projections (the fused launches of kernels.gemv_add_rms_norm /
gemv_silu_mul, forced everywhere) and with each as its own launch (those two calls replaced by their parts
here), in turn over several rounds; and whether the first step's logits are the same bit for bit. With
--b-src FILE (another gemv.cu beside it), the fused step on gemv.cu against the fused step on that file
instead; with --b-unsplit, against the fused step with every projection's row groups on one warp (gemv.cu's
SPLIT 1, as before warps shared the short projections' rows); with --b-plain, the step as the model runs it
(the launcher choosing) against the same step with every kernel launched without programmatic serialization. --mixed adds the step with only the norms
apart, the step with only the MLP gates apart, and the step as the model runs it (the launcher choosing per
shape, gemv.launch.fuses).

    python3 bench/decode_fused_ab.py [--model 9b] [--contexts 4096 32768] [--steps 64] [--rounds 3]
                                     [--b-src F | --b-unsplit | --b-plain | --mixed] [--out PATH]
"""
import argparse
import json
import statistics

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)

from qwen35_fast import kernels
from qwen35_fast.kernels import cuda_build
from qwen35_fast.kernels.gemv import launch as gemv_launch
from qwen35_fast.runtime.model import Qwen35Model

from e2e import SHAPES, graphed_decode_at, greedy_tok_per_s, random_weights_, shaped

# what the model calls: the launcher takes the fused launch where gemv.launch.fuses says it is faster
MODEL = {"gemv_add_rms_norm": kernels.gemv_add_rms_norm, "gemv_silu_mul": kernels.gemv_silu_mul}


def _add_norm_fused(res, x, norm_w, eps, weight, backend=None, scale=None):
    return gemv_launch.gemv_add_rms_norm_cuda(res, x, norm_w, eps, weight, fuse=True, scale=scale)


def _silu_mul_fused(gu, weight, backend=None, scale=None):
    return gemv_launch.gemv_silu_mul_cuda(gu, weight, fuse=True, scale=scale)


FUSED = {"gemv_add_rms_norm": _add_norm_fused, "gemv_silu_mul": _silu_mul_fused}  # every one fused


def _add_norm_apart(res, x, norm_w, eps, weight, backend=None, scale=None):
    s, n = (kernels.add_rms_norm(res, x, norm_w, eps, backend=backend) if x is not None
            else (res, kernels.rms_norm(res, norm_w, eps, backend=backend)))
    return s, kernels.gemv(n, weight, backend=backend, scale=scale)


def _silu_mul_apart(gu, weight, backend=None, scale=None):
    return kernels.gemv(kernels.silu_mul(gu, backend=backend), weight, backend=backend, scale=scale)


APART = {"gemv_add_rms_norm": _add_norm_apart, "gemv_silu_mul": _silu_mul_apart}


SPLIT_OF = gemv_launch.split_of


def use(model: Qwen35Model, fns: dict, src, split: bool = True, programmatic: bool = True) -> None:
    for name, fn in fns.items():
        setattr(kernels, name, fn)
    gemv_launch.SRC = src
    cuda_build.PROGRAMMATIC = programmatic
    gemv_launch.split_of = SPLIT_OF if split else (lambda *a: 1)
    model.set_decode_gemv(True)  # the captured passes are made again


def tok_per_s(model: Qwen35Model, n: int, steps: int) -> tuple[float, torch.Tensor]:
    torch.manual_seed(n)  # the same random context for both
    step, tok = graphed_decode_at(model, n, steps + 3)
    first = step(tok).float().clone()
    tps = greedy_tok_per_s(step, int(first.argmax()), steps)
    del step
    return tps, first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="9b", choices=sorted(SHAPES), help="the dense Qwen3.5 size whose shapes to run")
    ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 32768])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--b-src", default="", help="a gemv.cu to run the fused step on, against gemv.cu")
    ap.add_argument("--b-unsplit", action="store_true", help="B: every projection's row groups on one warp")
    ap.add_argument("--b-plain", action="store_true",
                    help="B: the step as the model runs it, every kernel launched without programmatic serialization")
    ap.add_argument("--mixed", action="store_true",
                    help="also each fusion alone: the norm's (PRO 1) apart, and the MLP gate's (PRO 2) apart")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    src = gemv_launch.SRC
    variants = ((("fused", FUSED, src, True), ("unsplit", FUSED, src, False)) if a.b_unsplit
                else (("fused", FUSED, src, True), ("fused_b", FUSED, a.b_src, True)) if a.b_src
                else (("fused", MODEL, src, True), ("plain", MODEL, src, True, False)) if a.b_plain
                else (("fused", FUSED, src, True), ("apart", APART, src, True)))
    if a.mixed:
        variants += (("norm_apart", {**FUSED, "gemv_add_rms_norm": APART["gemv_add_rms_norm"]}, src, True),
                     ("gate_apart", {**FUSED, "gemv_silu_mul": APART["gemv_silu_mul"]}, src, True),
                     ("model", MODEL, src, True))
    b = variants[1][0]
    model = Qwen35Model(shaped(a.model), torch.bfloat16, torch.device("cuda"))
    random_weights_(model)
    model.set_backend("cuda")
    rows = []
    for n in a.contexts:
        tps, first = {name: [] for name, *_ in variants}, {}
        for _ in range(a.rounds):
            for name, fns, s, split, *pdl in variants:
                use(model, fns, s, split, *pdl)
                t, first[name] = tok_per_s(model, n, a.steps)
                tps[name].append(round(t, 1))
        use(model, MODEL, src)
        row = {"context": n, "tok_per_s_fused": statistics.median(tps["fused"]),
               f"tok_per_s_{b}": statistics.median(tps[b]), "rounds": tps,
               "first_logits_equal": bool(torch.equal(first["fused"], first[b]))}
        if a.mixed:
            row["tok_per_s"] = {name: statistics.median(t) for name, t in tps.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(),
                       "model": f"Qwen3.5-{a.model.upper()}-shaped, random weights, bf16",
                       "shape": dict(zip(("hidden", "intermediate", "layers", "heads", "kv_heads", "gdn_value_heads"),
                                         SHAPES[a.model])),
                       "b": f"fused on {a.b_src}" if a.b_src else "fused, SPLIT 1 everywhere" if a.b_unsplit
                       else "the model's step, every launch without programmatic serialization" if a.b_plain
                       else b,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
