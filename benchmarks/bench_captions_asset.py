"""The captions asset's own overhead with an instantaneous backend, images/s per core.

Target: >= 2,000 images/s per core, so a GPU fleet is never waiting on the pipeline. A
synthetic batch of N eligible images is written to a temporary lab; the `captions` asset
is materialised with the alt-text backend (no model: the backend costs ~nothing), and the
backend alone is timed on the same inputs in the same process as the baseline. The asset
figure includes everything the asset does: Lance reads with projection and filters, row
building with provenance, the atomic partition commit, the full-text index and Dagster's
per-run overhead.

    python -m benchmarks.bench_captions_asset [--quick] [--n N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import pyarrow as pa  # noqa: E402
from dagster import instance_for_test, materialize  # noqa: E402

from prx_assets.core.captions.models import AltTextCaptioner, CaptionInput  # noqa: E402
from prx_assets.core.lab import Lab  # noqa: E402
from prx_assets.core.tables import IMAGES, RESOLUTION  # noqa: E402
from prx_assets.defs.captions.assets import build_caption_assets  # noqa: E402
from prx_assets.defs.captions.resources import (  # noqa: E402
    CaptionerResource,
    ClassifierResource,
    EmbedderResource,
)
from prx_assets.defs.partitions import BATCHES  # noqa: E402
from prx_assets.defs.resources import LabResource  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_captions_asset.json"
BATCH = "bench.000"
WORDS = "a photo of a red cup on a wooden table next to a window with soft light".split()


def _synthetic(lab: Lab, n: int) -> list[CaptionInput]:
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]
    alts = [" ".join(WORDS[(i % 5) :] + [str(i)]) for i in range(n)]
    images = pa.table(
        {
            "key": keys,
            "batch": [BATCH] * n,
            "alt_text": alts,
            "width": pa.array([1024] * n, pa.int32()),
            "height": pa.array([768] * n, pa.int32()),
            "file_size": pa.array([1000] * n, pa.int64()),
            "image": pa.array([b"\xff\xd8" + b"\0" * 64] * n, pa.large_binary()),
        }
    )
    full = pa.table(
        {f.name: images[f.name] if f.name in images.column_names else pa.nulls(n, f.type)
         for f in IMAGES.schema}
    )  # fmt: skip
    lab.replace_partition(IMAGES, BATCH, full)
    res = pa.table(
        {
            "key": keys,
            "batch": [BATCH] * n,
            "width": pa.array([1024] * n, pa.int32()),
            "height": pa.array([768] * n, pa.int32()),
            "megapixels": [0.786] * n,
            "aspect": [1024 / 768] * n,
            "eligible": [True] * n,
            "ineligible_reason": pa.nulls(n, pa.string()),
            "max_tier": pa.array([512] * n, pa.int32()),
        }
    )
    lab.replace_partition(RESOLUTION, BATCH, res)
    return [CaptionInput(key=k, image=None, alt_text=a) for k, a in zip(keys, alts, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, default=None)
    args = parser.parse_args()
    n = args.n or (5_000 if args.quick else 50_000)
    with tempfile.TemporaryDirectory() as tmp, instance_for_test() as instance:
        lab_res = LabResource(data_root=tmp)
        inputs = _synthetic(lab_res.lab(), n)
        captioner = CaptionerResource()
        assets = build_caption_assets(captioner, ClassifierResource(), EmbedderResource())
        captions_asset = next(a for a in assets if a.key.to_user_string() == "captions")
        instance.add_dynamic_partitions(BATCHES.name, [BATCH])

        backend = AltTextCaptioner()
        started = time.perf_counter()
        backend.caption(inputs)
        t_backend = time.perf_counter() - started

        started = time.perf_counter()
        result = materialize(
            [captions_asset],
            partition_key=BATCH,
            instance=instance,
            resources={"lab": lab_res, "captioner": captioner},
            selection=["captions"],
        )
        t_asset = time.perf_counter() - started
        assert result.success
        written = lab_res.lab().dataset("captions").count_rows()
        assert written == n, (written, n)
    out = {
        "images": n,
        "asset_images_per_s_per_core": round(n / t_asset, 1),
        "backend_alone_images_per_s": round(n / t_backend, 1),
        "asset_overhead_ms_per_image": round(1000 * (t_asset - t_backend) / n, 4),
        "asset_time_s": round(t_asset, 2),
        "target_images_per_s": 2000,
        "meets_target": n / t_asset >= 2000,
        "command": "python -m benchmarks.bench_captions_asset" + (" --quick" if args.quick else ""),
    }
    print(f"{'path':40} {'images/s':>12}")
    print(f"{'captions asset (alt-text backend)':40} {out['asset_images_per_s_per_core']:>12}")
    print(f"{'backend alone':40} {out['backend_alone_images_per_s']:>12}")
    print(f"asset overhead: {out['asset_overhead_ms_per_image']} ms/image; target >= 2,000/s: "
          f"{'met' if out['meets_target'] else 'NOT met'}")  # fmt: skip
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
