"""`make demo`: build the landing zone, let the landing sensor register it, run every stage."""

from __future__ import annotations

from pathlib import Path

from prx_assets.demo.build import build_demo_landing

# Keep the demo's console to warnings; every event is still in the instance (see the UI).
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def run_demo(data_root: Path, instance, size: str = "full") -> int:
    data_root = data_root.resolve()
    from dagster import build_sensor_context

    from prx_assets.core.tables import IMAGES, REJECTS, RESOLUTION
    from prx_assets.definitions import build_defs
    from prx_assets.defs.ingest.sensors import landing_sensor
    from prx_assets.defs.partitions import BATCHES
    from prx_assets.defs.resources import LabResource

    lab = LabResource(data_root=str(data_root))
    print(f"Building the demo landing zone in {lab.landing} ...")
    manifest = build_demo_landing(lab.landing, size=size)
    for key in manifest.batches:
        print(f"  {key}: {manifest.counts[key]} files")

    print("\nEvaluating the landing sensor once (the daemon does this every 30 s) ...")
    with build_sensor_context(instance=instance, resources={"lab": lab}) as ctx:
        result = landing_sensor(ctx)
    new_keys = []
    if hasattr(result, "dynamic_partitions_requests"):
        for req in result.dynamic_partitions_requests or []:
            new_keys += list(req.partition_keys)
        instance.add_dynamic_partitions(BATCHES.name, new_keys)
    print(f"  newly registered: {new_keys or 'none (already registered earlier)'}")

    job = build_defs(str(data_root)).resolve_job_def("batch_pipeline")
    failed = []
    for key in manifest.batches:
        print(f"Materialising every stage for partition {key} ...")
        res = job.execute_in_process(
            partition_key=key, instance=instance, raise_on_error=False, run_config=QUIET
        )
        if not res.success:
            failed.append(key)

    store = lab.lab()
    print("\nPer-partition results (from the Lance lab):")
    print(f"  {'partition':24} {'files':>6} {'accepted':>9} {'rejected':>9} {'eligible':>9}")
    for key in manifest.batches:
        flt = f"batch = '{key}'"
        acc = store.dataset(IMAGES.name).count_rows(flt)
        rej = store.dataset(REJECTS.name).count_rows(flt)
        elig = store.dataset(RESOLUTION.name).count_rows(f"{flt} AND eligible")
        print(f"  {key:24} {manifest.counts[key]:>6} {acc:>9} {rej:>9} {elig:>9}")
    print("\nRejections by reason:")
    reasons: dict[str, int] = {}
    for r in store.read(REJECTS.name, ["reason"]).column("reason").to_pylist():
        reasons[r] = reasons.get(r, 0) + 1
    for reason, n in sorted(reasons.items()):
        print(f"  {reason:28} {n}")
    if store.exists("captions"):
        caps = store.read("captions", ["backend", "model_id", "is_fallback", "length_ok"])
        n = caps.num_rows
        fallback = sum(caps.column("is_fallback").to_pylist())
        backends = sorted(set(caps.column("backend").to_pylist()))
        print(f"\nCaptions: {n} (backend: {', '.join(backends)})")
        if fallback:
            print(
                f"  {fallback} of them are the OFFLINE FALLBACK: the source's alt text, "
                "not a VLM caption."
            )
        print(f"  outside the 100-200 word window: {n - sum(caps.column('length_ok').to_pylist())}")
    if store.exists("caption_classes"):
        labels: dict[str, int] = {}
        for lab_ in store.read("caption_classes", ["label"]).column("label").to_pylist():
            labels[str(lab_)] = labels.get(str(lab_), 0) + 1
        print(f"Caption classes (embedding zero-shot fallback): {labels}")
    if store.exists("caption_embeddings"):
        print(f"Caption embeddings: {store.dataset('caption_embeddings').count_rows()}")
    if store.exists("shard_samples"):
        rows = store.read("shard_samples", ["relative_dir"]).column("relative_dir").to_pylist()
        per_dir: dict[str, int] = {}
        for d in rows:
            per_dir[d] = per_dir.get(d, 0) + 1
        print(f"\nMDS shards under {lab.shards_root} (JPEG q92, one directory per bucket x batch):")
        for d in sorted(
            per_dir, key=lambda x: [int(p) if p.isdigit() else p for p in x.split("/")]
        ):
            print(f"  {d}/  {per_dir[d]} samples")
    print(
        "\nTo caption with a real VLM: serve Qwen/Qwen3-VL-8B-Instruct with vLLM or SGLang, then\n"
        "  PRX_CAPTIONER=openai PRX_CAPTION_BASE_URL=http://127.0.0.1:8000/v1 \\\n"
        "  PRX_CAPTION_API_KEY=... make demo\n"
        "or load it in-process on a GPU: PRX_CAPTIONER=transformers "
        "PRX_CAPTION_MODEL=/path/to/Qwen3-VL-8B-Instruct make demo"
    )
    print(f"\nLance lab: {store.root}")
    print("Open the Dagster UI with `make ui`, then http://127.0.0.1:3000 (assets, partitions,")
    print("metadata such as the resolution histogram).")
    if failed:
        print(f"\nFAILED partitions: {', '.join(failed)}")
        return 1
    return 0
