"""GPU throughput of the in-process caption and classifier backends at production size.

What it measures: ``TransformersCaptioner`` on a Qwen3-VL-8B-shaped checkpoint (images/s,
generated tokens/s, peak GPU memory, load time) at several batch sizes, then
``TransformersClassifier`` on a Qwen3-8B-shaped checkpoint (captions/s). The weights are
random (configs and sources: :mod:`benchmarks.gpu_model_configs`): compute does not depend
on weight values, so the numbers are real throughput, but the text is noise. Random weights
never emit EOS on purpose, so EOS is disabled and every caption is exactly
``--max-new-tokens`` tokens (260 ~ a 200-word caption).

Baseline: each backend's smallest batch size, run in the same process; the ratio column is
the speedup over it. This is HF ``generate`` (static batches, no paged KV cache), not vLLM,
whose continuous batching is typically several times faster; no vLLM number is claimed.

    python -m benchmarks.bench_gpu_models            # CUDA only; prints "skipped" elsewhere
    python -m benchmarks.bench_gpu_models --tiny     # tiny configs, whole flow on CPU (<60 s)
    python -m benchmarks.bench_gpu_models --quick    # fewer images/captions on the GPU

Each phase builds the model on the device, saves it (safetensors, with processor/tokenizer)
to a temporary directory and loads it through the backend by path, exactly as a hub
checkpoint would be; the VLM directory is deleted before the LM is written (disk). Results
are written after every phase (so a timeout still leaves the finished phases) to
``--out`` and, when ``$OUT`` is set, to ``$OUT/bench_gpu_models.json``.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from PIL import Image  # noqa: E402

from benchmarks import gpu_model_configs as cfg  # noqa: E402
from prx_assets.core.captions.models import (  # noqa: E402
    LABELS,
    CaptionInput,
    TransformersCaptioner,
    TransformersClassifier,
)
from prx_assets.core.captions.models.prompts import (  # noqa: E402
    CAPTION_SYSTEM_PROMPT,
    CAPTION_USER_PROMPT,
)
from prx_assets.demo.jpegs import encoded  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_gpu_models.json"
WARMUP_TOKENS = 16

SEED_PIPELINE_FIGURES = {
    "caption_images_per_s_per_h200": 20,
    "classify_captions_per_s_per_gpu": 200,
    "note": "seed pipeline's production figures (vLLM serving, real weights); for context "
    "only, not measured here",
}


def demo_jpegs(long_side: int) -> list[tuple[str, bytes]]:
    """The demo photos resized so the long side is ``long_side`` px, as JPEG bytes."""
    root = resources.files("prx_assets") / "demo" / "photos"
    out = []
    for p in sorted(root.iterdir(), key=lambda p: p.name):
        if not p.name.endswith((".png", ".jpg")):
            continue
        img = Image.open(io.BytesIO(p.read_bytes())).convert("RGB")
        scale = long_side / max(img.size)
        img = img.resize(
            (max(1, round(img.width * scale)), max(1, round(img.height * scale))),
            Image.Resampling.BICUBIC,
        )
        out.append((p.name, encoded(img, "JPEG", quality=90)))
    if len(out) < 6:
        raise RuntimeError(f"demo photos missing under {root}")
    return out


def _cuda() -> Any:
    import torch

    return torch.cuda if torch.cuda.is_available() else None


def _sync() -> None:
    if cuda := _cuda():
        cuda.synchronize()


def _reset_peak() -> None:
    if cuda := _cuda():
        cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    cuda = _cuda()
    return cuda.max_memory_allocated() / 2**30 if cuda else None


def _allocated_gib() -> float | None:
    cuda = _cuda()
    return cuda.memory_allocated() / 2**30 if cuda else None


def _free() -> None:
    gc.collect()
    if cuda := _cuda():
        cuda.empty_cache()


def vision_stats(model_dir: Path, photos: list[tuple[str, bytes]], max_side: int) -> dict:
    """Prompt text tokens and merged vision tokens per image, as the captioner will see them."""
    from transformers import AutoProcessor

    from prx_assets.core.captions.models.base import load_caption_image

    proc = AutoProcessor.from_pretrained(model_dir)
    prompt = proc.apply_chat_template(
        [
            {"role": "system", "content": CAPTION_SYSTEM_PROMPT},
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": CAPTION_USER_PROMPT}],
            },
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    merge = proc.image_processor.merge_size**2
    counts = []
    for name, data in photos:
        img = load_caption_image(CaptionInput(name, image=data), max_side)
        grid = proc.image_processor(images=[img], return_tensors="pt")["image_grid_thw"][0]
        counts.append(int(grid.prod()) // merge)
    return {
        "prompt_text_tokens": len(proc.tokenizer(prompt, add_special_tokens=False).input_ids),
        "vision_tokens_per_image": {
            "min": min(counts),
            "mean": sum(counts) / len(counts),
            "max": max(counts),
        },
    }


def run_captioner(
    cap: TransformersCaptioner,
    items: list[CaptionInput],
    batch: int,
    time_cap_s: float,
) -> dict[str, Any]:
    """Whole batches of ``items`` until all are done or ``time_cap_s`` has passed."""
    cap.batch_size = batch
    steps = cap.max_new_tokens
    cap.max_new_tokens = WARMUP_TOKENS  # same shapes, short decode: kernels, allocator
    try:
        cap.caption(items[:batch])
    finally:
        cap.max_new_tokens = steps
    _sync()
    _reset_peak()
    done, batch_s, finishes = 0, [], set()
    words = 0
    start = time.perf_counter()
    while done < len(items) and (done == 0 or time.perf_counter() - start < time_cap_s):
        chunk = items[done : done + batch]
        t = time.perf_counter()
        results = cap.caption(chunk)
        _sync()
        batch_s.append(time.perf_counter() - t)
        finishes |= {r.finish_reason for r in results}
        words += sum(len(r.caption.split()) for r in results)
        done += len(chunk)
    wall = time.perf_counter() - start
    return {
        "batch_size": batch,
        "images": done,
        "batches": len(batch_s),
        "wall_s": wall,
        "images_per_s": done / wall,
        "generated_tokens_per_s": done * steps / wall,
        "s_per_batch_median": sorted(batch_s)[len(batch_s) // 2],
        "peak_gpu_mem_gib": _peak_gib(),
        "finish_reasons": sorted(f or "none" for f in finishes),
        "mean_words_per_caption": words / done,
    }


def run_classifier(
    clf: TransformersClassifier, captions: list[str], batch: int, time_cap_s: float
) -> dict[str, Any]:
    clf.batch_size = batch
    clf.classify(captions[:batch])
    _sync()
    _reset_peak()
    done, start = 0, time.perf_counter()
    while done < len(captions) and (done == 0 or time.perf_counter() - start < time_cap_s):
        chunk = captions[done : done + batch]
        probs = clf.classify(chunk)
        if len(probs) != len(chunk):
            raise RuntimeError(f"classifier returned {len(probs)} results for {len(chunk)}")
        done += len(chunk)
    _sync()
    wall = time.perf_counter() - start
    return {
        "batch_size": batch,
        "captions": done,
        "wall_s": wall,
        "captions_per_s": done / wall,
        "scored_rows_per_s": done * len(LABELS) / wall,
        "peak_gpu_mem_gib": _peak_gib(),
    }


def with_ratios(runs: list[dict[str, Any]], key: str) -> None:
    base = runs[0][key]
    for r in runs:
        r[f"{key}_vs_batch_{runs[0]['batch_size']}"] = r[key] / base


def caption_phase(args: argparse.Namespace, work: Path, tok: Any, device: str, res: dict) -> None:
    vl_dir = work / "qwen3-vl"
    info = cfg.build_vl_checkpoint(vl_dir, tok, args.tiny, device)
    _free()
    photos = demo_jpegs(args.photo_side)
    items = [
        CaptionInput(f"{i:04d}-{photos[i % len(photos)][0]}", image=photos[i % len(photos)][1])
        for i in range(args.n_images)
    ]
    cap = TransformersCaptioner(
        model_id=vl_dir, max_new_tokens=args.max_new_tokens, batch_size=args.caption_batches[0]
    )
    _reset_peak()
    t = time.perf_counter()
    cap_device = cap.device  # loads processor + weights, moves to the device
    _sync()
    info["load_s"] = time.perf_counter() - t
    info["device"] = cap_device
    info["resident_gpu_mem_gib"] = _allocated_gib()
    info.update(vision_stats(vl_dir, photos, cap.max_side))
    info["max_new_tokens"] = args.max_new_tokens
    info["photo_long_side_px"] = args.photo_side
    info["max_side"] = cap.max_side
    res["caption"] = {"checkpoint": info, "runs": []}
    for b in args.caption_batches:
        if _over_budget(args, res, args.time_cap_s):
            res["caption"]["runs"].append({"batch_size": b, "skipped": "time budget"})
            continue
        run = run_captioner(cap, items, b, args.time_cap_s)
        res["caption"]["runs"].append(run)
        _print_run("caption", run)
        write_results(res, args.out)
    measured = [r for r in res["caption"]["runs"] if "images_per_s" in r]
    if measured:
        with_ratios(measured, "images_per_s")
    del cap
    _free()
    shutil.rmtree(vl_dir)


def classify_phase(args: argparse.Namespace, work: Path, tok: Any, device: str, res: dict) -> None:
    if _over_budget(args, res, 60.0 + args.classify_time_cap_s):
        res["classify"] = {"skipped": "time budget"}
        return
    lm_dir = work / "qwen3"
    info = cfg.build_lm_checkpoint(lm_dir, tok, args.tiny, device)
    _free()
    captions = cfg.synthetic_captions(args.n_captions, words=args.caption_words)
    clf = TransformersClassifier(model_id=lm_dir, batch_size=args.classify_batches[0])
    _reset_peak()
    t = time.perf_counter()
    clf.label_token_ids  # noqa: B018 - loads tokenizer + weights
    _sync()
    info["load_s"] = time.perf_counter() - t
    info["resident_gpu_mem_gib"] = _allocated_gib()
    info["prompt_tokens_per_caption"] = len(
        tok(clf.prompt_text(captions[0]), add_special_tokens=False).input_ids
    )
    info["label_tokens"] = {
        lbl: len(ids) for lbl, ids in zip(LABELS, clf.label_token_ids, strict=True)
    }
    info["words_per_caption"] = args.caption_words
    res["classify"] = {"checkpoint": info, "runs": []}
    for b in args.classify_batches:
        if _over_budget(args, res, args.classify_time_cap_s):
            res["classify"]["runs"].append({"batch_size": b, "skipped": "time budget"})
            continue
        run = run_classifier(clf, captions, b, args.classify_time_cap_s)
        res["classify"]["runs"].append(run)
        _print_run("classify", run)
        write_results(res, args.out)
    measured = [r for r in res["classify"]["runs"] if "captions_per_s" in r]
    if measured:
        with_ratios(measured, "captions_per_s")
    del clf
    _free()
    shutil.rmtree(lm_dir)


def _over_budget(args: argparse.Namespace, res: dict, need_s: float) -> bool:
    """Whether something lasting ``need_s`` would end past ``--budget-s``."""
    return time.perf_counter() - res["_t0"] + need_s > args.budget_s


def _print_run(phase: str, r: dict[str, Any]) -> None:
    mem = r.get("peak_gpu_mem_gib")
    mem_s = f"{mem:6.1f} GiB" if mem is not None else "   n/a"
    if phase == "caption":
        print(
            f"  caption  B={r['batch_size']:<3d} {r['images']:4d} img {r['wall_s']:7.1f} s "
            f"{r['images_per_s']:7.2f} img/s {r['generated_tokens_per_s']:9.0f} tok/s "
            f" peak {mem_s}",
            flush=True,
        )
    else:
        print(
            f"  classify B={r['batch_size']:<3d} {r['captions']:4d} cap {r['wall_s']:7.1f} s "
            f"{r['captions_per_s']:7.1f} cap/s {r['scored_rows_per_s']:9.1f} rows/s  peak {mem_s}",
            flush=True,
        )


def write_results(res: dict[str, Any], out: Path) -> None:
    data = {k: v for k, v in res.items() if not k.startswith("_")}
    data["elapsed_s"] = time.perf_counter() - res["_t0"]
    text = json.dumps(data, indent=2) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_gpu_models.json").write_text(text)


def print_table(res: dict[str, Any]) -> None:
    print("\nphase     checkpoint (params, construct/save/load s)")
    for phase in ("caption", "classify"):
        if "skipped" in res.get(phase, {}):
            print(f"{phase:9s} skipped ({res[phase]['skipped']})")
        elif phase in res:
            c = res[phase]["checkpoint"]
            print(
                f"{phase:9s} {c['params'] / 1e9:.2f}B  {c['construct_s']:.1f} / {c['save_s']:.1f}"
                f" / {c['load_s']:.1f}  ({c['checkpoint_gib']:.1f} GiB on disk)"
            )
    for phase, key in (("caption", "images_per_s"), ("classify", "captions_per_s")):
        for r in res.get(phase, {}).get("runs", []):
            if "skipped" in r:
                print(f"{phase:9s} B={r['batch_size']:<3d} skipped ({r['skipped']})")
                continue
            ratio = next(v for k, v in r.items() if k.startswith(f"{key}_vs_batch_"))
            print(f"{phase:9s} B={r['batch_size']:<3d} {key}={r[key]:8.2f}  ratio {ratio:5.2f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny configs; runs on CPU")
    p.add_argument("--quick", action="store_true", help="fewer images and captions")
    p.add_argument("--n-images", type=int, default=None)
    p.add_argument("--n-captions", type=int, default=None)
    p.add_argument("--caption-batches", type=int, nargs="+", default=None)
    p.add_argument("--classify-batches", type=int, nargs="+", default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--caption-words", type=int, default=150)
    p.add_argument("--photo-side", type=int, default=1200, help="demo photos' long side, px")
    p.add_argument("--time-cap-s", type=float, default=None, help="per caption run")
    p.add_argument("--classify-time-cap-s", type=float, default=None, help="per classify run")
    p.add_argument("--budget-s", type=float, default=None, help="skip runs past this")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tiny:
        defaults: dict[str, Any] = dict(
            n_images=4, n_captions=32, caption_batches=[2, 4], classify_batches=[8, 16],
            max_new_tokens=16, time_cap_s=20.0, classify_time_cap_s=20.0, budget_s=300.0,
            out=Path(tempfile.gettempdir()) / "bench_gpu_models.tiny.json",
        )  # fmt: skip
    elif args.quick:
        defaults = dict(
            n_images=16, n_captions=256, caption_batches=[8, 16], classify_batches=[16, 64],
            max_new_tokens=260, time_cap_s=25.0, classify_time_cap_s=15.0, budget_s=200.0,
            out=RESULTS,
        )  # fmt: skip
    else:
        defaults = dict(
            n_images=64, n_captions=2048, caption_batches=[8, 32, 64],
            classify_batches=[16, 64], max_new_tokens=260, time_cap_s=45.0,
            classify_time_cap_s=30.0, budget_s=300.0,
            out=RESULTS,
        )  # fmt: skip
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.n_images < 1 or args.n_captions < 1 or args.max_new_tokens < 1:
        p.error("--n-images, --n-captions and --max-new-tokens must be >= 1")
    if min(args.caption_batches + args.classify_batches) < 1:
        p.error("batch sizes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    has_cuda = torch.cuda.is_available()
    if not args.tiny and not has_cuda:
        print("bench_gpu_models: skipped (no CUDA device; use --tiny for the CPU dry run)")
        return 0
    device = "cuda" if has_cuda else "cpu"
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_models_"))
    free_gib = shutil.disk_usage(work).free / 2**30
    if not args.tiny and free_gib < 25:
        print(f"bench_gpu_models: need ~20 GiB free under {work}, have {free_gib:.0f} GiB")
        return 1
    res: dict[str, Any] = {
        "_t0": time.perf_counter(),
        "benchmark": "bench_gpu_models",
        "mode": "tiny" if args.tiny else "quick" if args.quick else "full",
        "weights": "random (architecture-exact configs); throughput only, text is noise",
        "engine": "HF transformers generate / forward via the project's backends, not vLLM; "
        "vLLM continuous batching is typically several times faster (no number claimed)",
        "eos": "disabled: every caption decodes exactly max_new_tokens",
        "baseline": "ratio columns: speedup over the smallest batch size, same process",
        "seed_pipeline_reference": SEED_PIPELINE_FIGURES,
        "expected_params": cfg.EXPECTED_PARAMS,
        "env": {
            "device": torch.cuda.get_device_name(0) if has_cuda else platform.processor() or "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    print(f"bench_gpu_models ({res['mode']}) on {res['env']['device']}; work dir {work}")
    try:
        t = time.perf_counter()
        tok = cfg.build_tokenizer()
        res["tokenizer_build_s"] = time.perf_counter() - t
        caption_phase(args, work, tok, device, res)
        write_results(res, args.out)
        classify_phase(args, work, tok, device, res)
        write_results(res, args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(res)
    print(
        f"\nwrote {args.out}" + (" and $OUT/bench_gpu_models.json" if os.environ.get("OUT") else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
