"""`make demo`: build the landing zone, let the landing sensor register it, run every stage."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from prx_assets.demo.build import build_demo_landing


def make_variables(data_root: Path, cwd: Path | None = None) -> str:
    """What ``make ui`` and ``make browser`` need to show this run: its data root and
    Dagster home where they are not the Makefile's defaults (else another instance shows)."""
    cwd = (cwd or Path.cwd()).resolve()
    out = ""
    if data_root.resolve() != cwd / "data":
        out += f" PRX_DATA_ROOT={shlex.quote(str(data_root))}"
    home = os.environ.get("DAGSTER_HOME")
    if home and Path(home).resolve() != cwd / ".dagster_home":
        out += f" DAGSTER_HOME={shlex.quote(home)}"
    return out


def run_demo(data_root: Path, instance, size: str = "full", verbose: bool = False) -> int:
    data_root = data_root.resolve()
    from dagster import build_sensor_context

    from prx_assets.core.ingest.remote_landing import upload_landing
    from prx_assets.core.storage import is_remote
    from prx_assets.core.tables import IMAGES, REJECTS, RESOLUTION
    from prx_assets.definitions import DOWNSTREAM_OF_DEDUP, build_defs
    from prx_assets.defs.dedup.settle import describe_settle, settle_dedup_in_process
    from prx_assets.defs.ingest.sensors import landing_sensor
    from prx_assets.defs.partitions import BATCHES
    from prx_assets.defs.resources import lab_resource
    from prx_assets.defs.run_requests import console_logs
    from prx_assets.defs.skiplists.config import DEFAULT_OPTOUTS_DIRNAME
    from prx_assets.instance import local_run_tags

    lab = lab_resource(str(data_root))  # PRX_LANDING_URI / _LAB_URI / _SHARDS_URI: s3://
    # Where opt-out lists go (the opt-out sensor watches it), so a user finds it ready.
    (data_root / DEFAULT_OPTOUTS_DIRNAME).mkdir(parents=True, exist_ok=True)
    print(f"Building the demo landing zone in {lab.landing_uri} ...")
    if is_remote(lab.landing_uri):  # built locally, then put the way a producer must
        manifest = build_demo_landing(data_root / "landing-upload", size=size)
        upload_landing(data_root / "landing-upload", lab.landing_uri)
    else:
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

    defs = build_defs(str(data_root))
    job = defs.resolve_job_def("batch_pipeline")
    failed = []
    for key in manifest.batches:
        print(f"Materialising every stage for partition {key} ...")
        res = job.execute_in_process(
            partition_key=key,
            instance=instance,
            raise_on_error=False,
            run_config=console_logs(verbose),  # step summaries and progress; -v: events
            tags=local_run_tags(),
        )
        if not res.success:
            failed.append(key)

    store = lab.lab()
    # A later batch can hold a bigger copy of an earlier image: what the dedup sensor would
    # request (that earlier batch's cluster decisions and skip-lists, never its shards)
    # runs here until nothing is stale, so the demo ends settled without a daemon.
    print("\nSettling cross-batch dedup (the dedup sensor's reruns, run here) ...")
    report = settle_dedup_in_process(
        defs, instance, DOWNSTREAM_OF_DEDUP, tags=local_run_tags(), log=lambda m: print(f"  {m}")
    )
    print(f"  {describe_settle(report)}")
    if not report.settled:
        failed.append("dedup")

    print("\nPer-partition results (from the Lance lab):")
    print(f"  {'partition':24} {'files':>6} {'accepted':>9} {'rejected':>9} {'eligible':>9}")
    for key in manifest.batches:
        flt = f"batch = '{key}'"
        acc = store.count(IMAGES.name, flt)
        rej = store.count(REJECTS.name, flt)
        elig = store.count(RESOLUTION.name, f"{flt} AND eligible")
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
        print(f"Caption embeddings: {store.count('caption_embeddings')}")
    if store.exists("phash_clusters"):
        from prx_assets.core.dedup.planted import summarise_planted

        planted = summarise_planted(store, manifest)
        clusters = store.read("phash_clusters", ["is_keeper", "low_information"])
        dups = clusters.num_rows - sum(clusters.column("is_keeper").to_pylist())
        print(
            f"\nDedup (pHash, Hamming 0): {dups} duplicates marked non-keeper; planted duplicate "
            f"pairs found {planted['found']} of {planted['planted']} "
            f"(keeper = higher resolution: {planted['keeper_is_higher_resolution']}; "
            f"not hashed yet: {planted['not_hashed']}; copies under the size cutoff are "
            f"hashed too, so an opt-out naming one reaches its larger copies)"
        )
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
    if store.exists("skip_audit"):
        audit = store.read("skip_audit", ["reasons", "excluded"])
        reasons: dict[str, int] = {}
        for rs in audit.column("reasons").to_pylist():
            for r in rs or []:
                reasons[r] = reasons.get(r, 0) + 1
        excluded = sum(audit.column("excluded").to_pylist())
        print(
            f"Skip-lists: {excluded} of {audit.num_rows} shard samples skipped; reasons {reasons}"
        )
        from prx_assets.core.skiplists.decisions import caption_coverage

        for key in manifest.batches:
            cov = caption_coverage(store, key)
            print(f"  {key}: {cov.without_caption} of {cov.eligible} eligible without a caption")
        from prx_assets.demo.train_loop import run_training_loop

        print("\nTraining-style loop over the shards (prx_assets.loader, no Dagster):")
        loop = run_training_loop(lab.shards_root, store)
        print(
            f"  {loop['samples']} samples in {loop['batch_shapes']} batch shapes, "
            f"{loop['samples_per_s']:.0f} samples/s incl. decode + on-the-fly text encoding"
        )
        if loop["small_bucket_warnings"]:
            print(
                f"  {loop['small_bucket_warnings']} buckets are smaller than canonical nodes x "
                "batch size (expected on a demo; a training hazard at scale)"
            )
        for w in loop["other_warnings"]:
            print(f"  note: {w}")
        if loop["skipped_sample_yielded"]:
            print(f"  ERROR: skipped samples were yielded: {loop['skipped_sample_yielded']}")
            failed.append("loader")
        else:
            print(f"  no skipped sample appeared ({loop['excluded_keys']} keys excluded)")
    print(
        "\nTo caption with a real VLM: serve Qwen/Qwen3-VL-8B-Instruct with vLLM or SGLang, then\n"
        "  PRX_CAPTIONER=openai PRX_CAPTION_BASE_URL=http://127.0.0.1:8000/v1 \\\n"
        "  PRX_CAPTION_API_KEY=... make demo\n"
        "or load it in-process on a GPU: PRX_CAPTIONER=transformers "
        "PRX_CAPTION_MODEL=/path/to/Qwen3-VL-8B-Instruct make demo"
    )
    print(f"\nLance lab: {store.root}")
    where = make_variables(data_root)
    print(f"Open the Dagster UI with `make ui{where}`, then http://127.0.0.1:3000 (assets,")
    print("partitions, metadata such as the resolution histogram); the curation browser with")
    print(f"`make browser{where}`, then http://127.0.0.1:8765.")
    if failed:
        print(f"\nFAILED partitions: {', '.join(failed)}")
        return 1
    return 0
