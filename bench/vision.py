"""The vision tower on the GPU: ours against transformers' Qwen3_5VisionModel (same random weights, bf16,
transformers' default attention), and the time to first token for a 9B-shaped model answering a
question about one 1024x1024 image. Writes bench/results/vision-h200.json (or --out):

  {"impl": "ours" | "ours-torch" | "transformers", "tower": "27x1152", "images": ..., "ms", "floor_ms", ...}
  {"impl": "ours-e2e" | "transformers-e2e" | "transformers-e2e-generate", "ttft_ms": ...}: use_cache off (no
    states kept); ours-e2e's A/B keys: ttft_ms_full_last_layer (the last layer for every token), ttft_ms_cuts_<form>
    (the runtime's default: read cold with the states kept at the cuts; runtime / parts / kept / packed forms)
  {"impl": "ours-bucket", "ms", "ms_eager", ...}: images of two sizes of one graph bucket in turn (bucket_row)
  {"impl": "ours-e2e-bucket", "ttft_ms", "ttft_ms_tower_eager", ...}: the first token about them (bucket_e2e)

"ours" runs the tower on the kernel backend the text model would pick ("auto": the CUDA kernels for the
rotary and the LayerNorms where they run), a fresh plan each call ("ms"), and as the runtime runs a size
that repeats ("ms_repeat": the kept plan, a CUDA graph from the second call); "ours-torch" on the PyTorch
references.
floor = the tower's matmul FLOPs / the bf16 matmul rate measured in the same run (ours-e2e: the tower's and
the whole prompt's text-model FLOPs, Qwen35Model.flops). Each size's four timings are
taken in turn, one call of each a round in a shuffled order (medians over --reps rounds).

    python3 bench/vision.py [--reps 12] [--layers 32] [--no-transformers-e2e] [--out PATH]
"""
import argparse
import json
import random
import time
from pathlib import Path

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast import kernels
from qwen35_fast.runtime import model as model_mod
from qwen35_fast.runtime.media import Preprocessing, preprocess_images, preprocess_video
from qwen35_fast.runtime.model import KeptCuts, PackedCuts, Qwen35Model
from qwen35_fast.runtime.vision import VisionConfig, VisionTower, _targets, tower_passes
from qwen35_fast.runtime.vision import plan as vision_plan

TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16)  # 9B and 27B
OUT_HIDDEN = 4096  # 9B's text width


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_weights_(tower: VisionTower) -> VisionTower:
    """The tower's weights random at a trained tower's scale, in place: matrices normal(0, 0.02), LayerNorm
    scales 1 (0 would make every token zero), biases 0."""
    with torch.no_grad():
        for k, p in _targets(tower).items():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0 if "norm" in k and k.endswith("weight") else 0.0)
    return tower


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def merged(out):
    """The merger's output, whatever form this transformers version returns it in."""
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "pooler_output", None) is not None:
        return out.pooler_output
    return out[0]


def timed(fn, reps):
    return timed_in_turn({"": fn}, reps)[""]


def timed_in_turn(fns: dict, reps: int, warmup: int = 2) -> dict:
    """Median ms of each of fns, called one after the other in each of reps rounds (after warmup rounds), the
    GPU idle at each call's start: drift of the clocks or of the host's speed during the run falls on all of
    them alike, not on whichever ran first. Each round calls them in its own order (a seeded shuffle): what
    runs just before a call (a heavy one holds the clocks down for a while) varies, and does not always
    favour or burden the same fn."""
    times = {k: [] for k in fns}
    order, rng = list(fns.items()), random.Random(0)
    for r in range(warmup + reps):
        rng.shuffle(order)
        for k, fn in order:
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= warmup:
                times[k].append((time.perf_counter() - t0) * 1000)
    return {k: sorted(t)[len(t) // 2] for k, t in times.items()}


def bf16_rate() -> float:
    """FLOP/s of an 8192^3 bf16 matmul on this card now: ten back to back per timing, so the host's wait for
    the GPU (a few us) does not lower the rate and so raise the floor."""
    n = 8192 if DEV.type == "cuda" else 512
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    ms = timed(lambda: [a @ b for _ in range(10)], 20) / 10
    return 2 * n ** 3 / (ms / 1000)


def inputs(scale: int = 1):
    """(name, [VisionInput]) for the three rows, preprocessed as the node does (sides / scale for --smoke)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    side, vh, vw = 1024 // scale, 720 // scale, 1280 // scale
    img = torch.rand(4, side, side, 3, device=DEV, generator=g)
    frames = torch.rand(32, vh, vw, 3, device=DEV, generator=g)
    pp = Preprocessing(min_pixels=32 * 32) if scale > 1 else Preprocessing()
    one = preprocess_images(img[:1], pp)
    four = preprocess_images(img, pp)
    video = [preprocess_video(frames, fps=2.0, pp=pp)]  # 16 s at 2 fps: all 32 frames
    return [("1x1024x1024", one), ("4x1024x1024", four), ("video 32x720x1280", video)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=32, help="text layers of the e2e model")
    ap.add_argument("--no-transformers-e2e", action="store_true")
    ap.add_argument("--e2e-only", action="store_true", help="only the first-token rows (the text model's A/Bs)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device: checks the script runs")
    ap.add_argument("--compile-budget-s", type=float, default=150,
                    help="also time the tower under torch.compile (1 image) when this many seconds have not passed")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "vision-h200.json"))
    args = ap.parse_args()
    import transformers
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    global TOWER, OUT_HIDDEN
    if args.smoke:
        TOWER, OUT_HIDDEN = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2), 256
        args.layers, args.reps = 4, 1
    dev = DEV
    start = time.perf_counter()
    rate = bf16_rate()
    print(f"bf16 matmul rate {rate / 1e12:.0f} TFLOP/s")
    cfg = Qwen3_5VisionConfig(**TOWER, out_hidden_size=OUT_HIDDEN)
    torch.manual_seed(0)
    with torch.device(dev):
        ref = Qwen3_5VisionModel(cfg).to(torch.bfloat16).eval()
    vc = VisionConfig(**TOWER, out_hidden_size=OUT_HIDDEN)
    ours = VisionTower(vc, torch.bfloat16, dev)
    sd = ref.state_dict()
    same_weights = all(k in sd for k in _targets(ours))
    if same_weights:
        with torch.no_grad():
            for k, p in _targets(ours).items():
                p.copy_(sd[k].reshape(p.shape))
    else:  # another transformers layout: time on random weights of the same scale, compare nothing
        random_weights_(ours)
    if not same_weights:
        print("transformers' tower names its weights differently here: no output comparison")
    be = kernels.select_backend("auto", dev, torch.bfloat16)
    print(f"tower backend: {be.reason}")
    rows = []
    for name, items in [] if args.e2e_only else inputs(16 if args.smoke else 1):
        grids = [i.grid for i in items]
        pixels = torch.cat([i.pixels for i in items]).to(torch.bfloat16)
        grid_t = torch.tensor(grids, device=dev)
        plan = ours.plan(grids)
        floor = ours.flops(grids) / rate * 1000
        with torch.inference_mode():
            a = ours(pixels, plan, backend=be)
            b = merged(ref(pixels, grid_thw=grid_t))
            err = float((a.float() - b.float()).norm() / b.float().norm()) if same_weights else None
            fresh = lambda: vision_plan(ours.config, grids, ours.device)  # noqa: E731  (not the tower's kept plan)

            def ours_fresh():  # what VisionTower.run runs for new grids: its passes, each planned (not the kept plan)
                out, lo = [], 0
                for part in tower_passes(grids):
                    p = vision_plan(ours.config, part, ours.device)
                    out.append(ours(pixels[lo:lo + p.n_patches], p, backend=be))
                    lo += p.n_patches
                return out
            ms = timed_in_turn({
                "ours": ours_fresh,  # planning included
                # what the runtime runs when the size repeats (a batch of renders): the kept plan, and from the
                # second call a CUDA graph (VisionTower.run; eager where it takes none, e.g. over GRAPH_PATCHES)
                "repeat": lambda: ours.run(pixels, grids, backend=be),
                "torch": lambda: ours(pixels, fresh()),
                "transformers": lambda: ref(pixels, grid_thw=grid_t)}, args.reps)
            ms_ours, ms_repeat, ms_torch, ms_ref = ms["ours"], ms["repeat"], ms["torch"], ms["transformers"]
        common = {"tower": vc.shape_name, "images": name, "grids": grids, "floor_ms": round(floor, 2),
                  "tflop": round(ours.flops(grids) / 1e12, 2)}
        rows.append({"impl": "ours", **common, "ms": round(ms_ours, 2), "ms_repeat": round(ms_repeat, 2),
                     "tower_passes": len(tower_passes(grids)),
                     "rel_err_vs_transformers_bf16": err, "backend": be.name})
        rows.append({"impl": "ours-torch", **common, "ms": round(ms_torch, 2), "backend": "torch"})
        rows.append({"impl": "transformers", **common, "ms": round(ms_ref, 2)})
        print(f"{name}: ours {ms_ours:.2f} ms ({be.name}; size repeating {ms_repeat:.2f}), ours on the references "
              f"{ms_torch:.2f} ms, "
              f"transformers {ms_ref:.2f} ms, floor {floor:.2f} ms, rel err {err}")
    if not args.smoke and not args.e2e_only:
        rows.append(bucket_row(ours, be, rate, args.reps))
    ref = None  # frees the weights (the closures above are done with it)

    def save():
        if args.smoke:
            return
        out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": transformers.__version__, "bf16_tflops": round(rate / 1e12, 1), "host_cpu": host_cpu(),
               "rows": rows}
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")

    save()
    rows += e2e(args, ours, rate)
    save()
    if time.perf_counter() - start < args.compile_budget_s and not args.e2e_only:  # last: a timeout loses this row
        name, items = inputs(16 if args.smoke else 1)[0]
        grids = [i.grid for i in items]
        pixels = torch.cat([i.pixels for i in items]).to(torch.bfloat16)
        plan = ours.plan(grids)
        t0 = time.perf_counter()
        compiled = torch.compile(ours.forward)
        with torch.inference_mode():
            compiled(pixels, plan, backend=be)
        compile_s = time.perf_counter() - t0
        ms = timed(lambda: compiled(pixels, plan, backend=be), args.reps)
        rows.append({"impl": "ours-compiled", "tower": vc.shape_name, "images": name, "grids": grids, "ms": round(ms, 2),
                     "floor_ms": round(ours.flops(grids) / rate * 1000, 2), "compile_s": round(compile_s, 1),
                     "backend": be.name,
                     "note": "torch.compile (inductor) of the tower's forward; plan made once, outside the timing"})
        print(f"{name}: ours compiled {ms:.2f} ms (compile {compile_s:.0f} s)")
        save()
    print(json.dumps(rows, indent=1))


# two image sizes of one graph bucket, 1024 high (3,840 and 3,968 patches: bucket 4,096), for bucket_row / bucket_e2e
BUCKET_WIDTHS = (960, 992)
BUCKET_IMAGES = " / ".join(f"1x1024x{w}" for w in BUCKET_WIDTHS) + " in turn"


def bucket_row(ours: VisionTower, be, rate: float, reps: int) -> dict:
    """Images of two sizes of one graph bucket (1024 x 960 and 1024 x 992: 3,840 and 3,968 patches, bucket 4,096),
    one after the other, each call another size than the last: VisionTower.run replays the bucket's padded graph
    (captured on the second call); against each size eager with a fresh plan (what run does for a new size of a
    bucket it holds no graph of; a size among its kept plans saves the plan's ~0.15 ms of host)."""
    vc, dev = ours.config, ours.device
    sizes = [[(1, 64, w // 16)] for w in BUCKET_WIDTHS]
    px = [torch.randn(t * h * w, vc.patch_dim, device=dev, generator=torch.Generator(dev).manual_seed(i)).bfloat16()
          for i, [(t, h, w)] in enumerate(sizes)]
    turn = {"run": 0, "eager": 0}

    def call(kind):
        i = turn[kind] = 1 - turn[kind]
        if kind == "run":
            return ours.run(px[i], sizes[i], backend=be)
        return ours(px[i], vision_plan(vc, sizes[i], dev), backend=be)
    with torch.inference_mode():
        for _ in range(3):
            call("run")
        ms = timed_in_turn({k: (lambda k=k: call(k)) for k in turn}, reps)
        key = ours._graph.key if ours._graph is not None else None
    floor = sum(ours.flops(s) for s in sizes) / 2 / rate * 1000
    print(f"two sizes of one bucket in turn: {ms['run']:.2f} ms (graph {key}), eager {ms['eager']:.2f}, "
          f"floor {floor:.2f}")
    return {"impl": "ours-bucket", "tower": vc.shape_name, "images": BUCKET_IMAGES,
            "grids": sizes, "floor_ms": round(floor, 2), "ms": round(ms["run"], 2), "ms_eager": round(ms["eager"], 2),
            "graph": list(key) if key is not None else None, "backend": be.name,
            "note": "each call another size than the last; ms: VisionTower.run (the bucket's padded graph), "
                    "ms_eager: the tower eager with a fresh plan"}


def e2e(args, tower: VisionTower, rate: float):
    """Time to first token, 9B-shaped random model, one 1024x1024 image and a 50-token question."""
    from qwen35_fast.runtime.multimodal import IMAGE_PAD, prefill_multimodal
    from qwen35_fast.runtime.tokenizer import load_tokenizer

    from e2e import nine_b, random_weights_

    dev = DEV
    cfg = nine_b(args.layers)
    if args.smoke:
        from dataclasses import replace
        cfg = replace(cfg, hidden_size=OUT_HIDDEN, intermediate_size=256, num_attention_heads=2,
                      num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=2)
    model = Qwen35Model(cfg, torch.bfloat16, dev)
    random_weights_(model)
    model.tokenizer = load_tokenizer(None)
    model.vision = tower
    model.path = None
    model.set_backend("auto")
    words = ("What colour is the large object near the left edge of the picture, and what is it made of? "
             "Describe its shape, its size compared with the things around it, the light on it, and whether "
             "anything in the scene suggests where or when the picture was taken.").split()
    encode = getattr(model.tokenizer, "encode_text", model.tokenizer.encode)
    n = next(k for k in range(1, len(words) + 1) if len(encode(" ".join(words[:k]))) >= 50)
    question = " ".join(words[:n])
    n_q = len(encode(question))
    side = 64 if args.smoke else 1024
    image = torch.rand(1, side, side, 3, device=dev, generator=torch.Generator(device=dev).manual_seed(1))

    def ttft():  # use_cache off: every repetition reads the image and the question (no prefix reuse)
        pf = prefill_multimodal(model, question, images=image, use_cache=False)
        return int(pf.logits.argmax())

    def cold_kept():  # use_cache on, nothing cached: the prompt is read cold and its states kept at the cuts
        model.kv.pool.clear()
        pf = prefill_multimodal(model, question, images=image)
        return int(pf.logits.argmax())

    def variant(run_one=ttft, form=None, full_last=False):
        """run_one with the cut states in another form than cut_form's (A/B; bench/gdn_cuts_ab.py's forms) or the
        last layer run for every token (the runtime runs it for the last one)."""
        real_form, real_layers = model_mod.cut_form, Qwen35Model._layers

        def run():
            if form is not None:
                model_mod.cut_form = form
            if full_last:
                Qwen35Model._layers = lambda self, h, *a, kv_last=None, **kw: real_layers(self, h, *a, **kw)[:, -1:]
            try:
                return run_one()
            finally:
                model_mod.cut_form, Qwen35Model._layers = real_form, real_layers
        return run

    # ttft reads the prompt without keeping states (use_cache off: no cuts); the cuts_* rows read it cold with
    # the runtime's default, the states kept at the cuts (end of the image, of the user turn) in each form
    forms = timed_in_turn({"runtime": ttft, "full_last_layer": variant(full_last=True), "cuts_runtime": cold_kept,
                           "cuts_parts": variant(cold_kept, form=lambda cuts, T, be, device: None),
                           "cuts_kept": variant(cold_kept, form=lambda cuts, T, be, device: KeptCuts.plan(cuts, be,
                                                                                                          device)),
                           "cuts_packed": variant(cold_kept, form=lambda cuts, T, be, device: PackedCuts.build(
                               cuts, T, device))}, args.reps)
    ms = forms["runtime"]
    pf = prefill_multimodal(model, question, images=image, use_cache=False)
    flop = tower.flops(pf.vision.grids) + model.flops(pf.n_tokens)  # the image's tower, the whole prompt's LM
    rows = [{"impl": "ours-e2e", "ttft_ms": round(ms, 2), "floor_ms": round(flop / rate * 1000, 2),
             "tflop": round(flop / 1e12, 2), "prompt_tokens": pf.n_tokens,
             "image_tokens": sum(1 for t in pf.token_ids if t == IMAGE_PAD), "question_tokens": n_q,
             "vision_ms": round(pf.vision.vision_ms, 2), "prefill_ms": round(pf.vision.prefill_ms, 2),
             **{f"ttft_ms_{k}": round(v, 2) for k, v in forms.items() if k != "runtime"}, "backend": model.backend.name}]
    print(f"ours e2e: ttft {ms:.1f} ms ({pf.n_tokens} tokens; vision {pf.vision.vision_ms:.1f} ms); A/B forms: "
          + ", ".join(f"{k} {v:.1f}" for k, v in forms.items()))
    if not args.smoke:
        try:
            rows.append(bucket_e2e(model, question, args.reps))
        except Exception as e:  # noqa: BLE001 - the row says why it is missing; transformers' rows still come
            rows.append({"impl": "ours-e2e-bucket", "error": f"{type(e).__name__}: {e}"[:300]})
    if args.no_transformers_e2e:
        return rows
    ids = torch.tensor([pf.token_ids], device=dev)
    model = pf = None
    torch.cuda.empty_cache()
    try:
        rows += transformers_e2e(args, ids, image, cfg)
    except Exception as e:  # noqa: BLE001 - the row says why it is missing
        rows.append({"impl": "transformers-e2e", "error": f"{type(e).__name__}: {e}"[:300]})
    return rows


def bucket_e2e(model, question: str, reps: int) -> dict:
    """Time to first token for the question about images of two sizes of one graph bucket (1024 x 960 and
    1024 x 992) in turn, each call another size than the last: the tower replaying the bucket's padded graph, as
    VisionTower.run does once two such sizes came in a row, against the tower eager (QWEN35_CUDA_GRAPHS=0 for the
    call: what a new size costs without a graph of its bucket; the cold prompt's text layers take no graph)."""
    import os

    from qwen35_fast.runtime.multimodal import prefill_multimodal
    images = [torch.rand(1, 1024, w, 3, device=DEV, generator=torch.Generator(device=DEV).manual_seed(2 + i))
              for i, w in enumerate(BUCKET_WIDTHS)]
    turn = {"graph": 0, "eager": 0}

    def call(kind):
        i = turn[kind] = 1 - turn[kind]
        os.environ["QWEN35_CUDA_GRAPHS"] = "0" if kind == "eager" else "1"  # read at each tower call
        return int(prefill_multimodal(model, question, images=images[i], use_cache=False).logits.argmax())
    for _ in range(3):
        call("graph")
    ms = timed_in_turn({k: (lambda k=k: call(k)) for k in turn}, reps)
    os.environ.pop("QWEN35_CUDA_GRAPHS")
    key = model.vision._graph.key if model.vision._graph is not None else None
    print(f"ours e2e, two sizes of one bucket in turn: ttft {ms['graph']:.1f} ms (tower graph {key}), "
          f"tower eager {ms['eager']:.1f} ms")
    return {"impl": "ours-e2e-bucket", "images": BUCKET_IMAGES, "ttft_ms": round(ms["graph"], 2),
            "ttft_ms_tower_eager": round(ms["eager"], 2), "graph": list(key) if key is not None else None,
            "backend": model.backend.name}


def transformers_e2e(args, ids, image, c):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from qwen35_fast.runtime.multimodal import IMAGE_PAD

    from e2e import hf_text_config

    try:
        import fla  # noqa: F401
        has_fla = True
    except ImportError:
        has_fla = False
    dev = ids.device
    text = hf_text_config(c)
    cfg = Qwen3_5Config(text_config=text, vision_config={**TOWER, "out_hidden_size": OUT_HIDDEN})
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            hf = Qwen3_5ForConditionalGeneration(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    inp = preprocess_images(image, Preprocessing())[0]  # what prefill_multimodal used
    kw = dict(input_ids=ids, mm_token_type_ids=(ids == IMAGE_PAD).int(),
              pixel_values=inp.pixels.to(torch.bfloat16), image_grid_thw=torch.tensor([inp.grid], device=dev))
    with torch.inference_mode():
        try:
            hf(**kw, use_cache=True, logits_to_keep=1)
        except (TypeError, ValueError) as e:  # a transformers version without mm_token_type_ids
            if "mm_token_type_ids" not in str(e):
                raise
            kw.pop("mm_token_type_ids")

    def ttft():
        with torch.inference_mode():
            out = hf(**kw, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    ms = timed(ttft, args.reps)
    print(f"transformers e2e: ttft {ms:.1f} ms (fla {has_fla})")
    rows = [{"impl": "transformers-e2e", "ttft_ms": round(ms, 2), "fla": has_fla,
             "note": "one model forward on the processor's pixel values, logits of the last position only "
                     "(preprocessing not timed)"}]

    def first_token():  # what a transformers user calls for a first token: generate, one new token, greedy
        with torch.inference_mode():
            out = hf.generate(**kw, max_new_tokens=1, do_sample=False)
        return int(out[0, -1])

    try:
        first_token()
        ms = timed(first_token, args.reps)
    except Exception as e:  # noqa: BLE001 - the row says why it is missing
        rows.append({"impl": "transformers-e2e-generate", "error": f"{type(e).__name__}: {e}"[:300]})
        return rows
    print(f"transformers e2e through generate: ttft {ms:.1f} ms")
    rows.append({"impl": "transformers-e2e-generate", "ttft_ms": round(ms, 2), "fla": has_fla,
                 "note": "generate(max_new_tokens=1, greedy) on the processor's pixel values (preprocessing "
                         "not timed)"})
    return rows


if __name__ == "__main__":
    main()
