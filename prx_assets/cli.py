"""Command line: the demo, registering a batch by hand, audits, training snapshots, opt-out
compliance, export and bucket creation (`prx-assets --help`; the browser has its own)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _instance():
    """The instance at $DAGSTER_HOME, created or migrated once under a lock (see instance.py)."""
    from prx_assets.instance import ensure_instance

    if not os.environ.get("DAGSTER_HOME"):
        sys.exit("DAGSTER_HOME is not set (the Makefile sets it to .dagster_home)")
    return ensure_instance()


def _run_partition(instance, key: str, data_root: str, verbose: bool = False) -> bool:
    """Materialise every stage of one partition here, then settle cross-batch dedup.

    Without a daemon nobody ticks ``dedup_sensor``: a batch holding a bigger copy of an
    earlier batch's image would leave that earlier copy in training. So the reruns the
    sensor would request run here too, until nothing is stale (bounded; see settle.py).
    """
    from dagster import AssetCheckSeverity

    from prx_assets.definitions import DOWNSTREAM_OF_DEDUP, build_defs
    from prx_assets.defs.dedup.settle import describe_settle, settle_dedup_in_process
    from prx_assets.defs.run_requests import console_logs
    from prx_assets.instance import local_run_tags

    defs = build_defs(data_root)
    job = defs.resolve_job_def("batch_pipeline")
    result = job.execute_in_process(
        partition_key=key,
        instance=instance,
        raise_on_error=False,
        tags=local_run_tags(),
        run_config=console_logs(verbose),  # the steps' lines and progress; -v: every event
    )
    print(f"{key}: {'materialised' if result.success else 'FAILED (see the run in the UI)'}")
    # A run whose ERROR-severity checks failed succeeded as a run, not as a result: say so
    # and exit non-zero (a WARN check is printed and does not fail the command).
    failed = [e for e in result.get_asset_check_evaluations() if not e.passed]
    for e in failed:
        print(
            f"{key}: check {e.check_name} on {e.asset_key.to_user_string()} FAILED "
            f"({e.severity.value})",
            file=sys.stderr,
        )
    errors = [e for e in failed if e.severity == AssetCheckSeverity.ERROR]
    report = settle_dedup_in_process(defs, instance, DOWNSTREAM_OF_DEDUP, tags=local_run_tags())
    print(describe_settle(report))
    return result.success and not errors and report.settled


def register_batch(args: argparse.Namespace) -> int:
    from prx_assets.core.ingest.sources import BatchError, describe_batch
    from prx_assets.defs.partitions import BATCHES
    from prx_assets.defs.resources import LabResource, default_data_root

    lab = LabResource(data_root=args.data_root or default_data_root())
    try:
        ref = describe_batch(Path(args.path), lab.landing)
    except BatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    instance = _instance()
    if instance.has_dynamic_partition(BATCHES.name, ref.key):
        print(f"{ref.key}: already registered")
    else:
        instance.add_dynamic_partitions(BATCHES.name, [ref.key])
        print(f"{ref.key}: registered ({ref.kind} at {ref.path})")
    if args.materialize:
        ok = _run_partition(instance, ref.key, lab.data_root, args.verbose)
        from prx_assets.core.skiplists.decisions import caption_coverage

        cov = caption_coverage(lab.lab(), ref.key)
        print(
            f"{ref.key}: {cov.without_caption} of {cov.eligible} eligible image(s) have no "
            "usable caption (skipped as no_caption)"
        )
        return 0 if ok else 1
    return 0


def audit(args: argparse.Namespace) -> int:
    """The verdict on the first line (plain text), then the trail; exit 1 when not found."""
    from prx_assets.core.audit import NoLab, audit_image
    from prx_assets.core.lab import Lab
    from prx_assets.core.markdown import bounded, visible
    from prx_assets.defs.resources import LabResource, default_data_root

    resource = LabResource(data_root=args.data_root or default_data_root())
    missing = _no_lab(resource)
    if missing:
        return missing
    from prx_assets.core.snapshots.manifest import SnapshotError

    try:
        trail = audit_image(
            Lab(resource.lab_root),
            args.query,
            landing=resource.landing,
            shards_root=resource.shards_root,
        )
    except NoLab as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SnapshotError as exc:  # which snapshots held it cannot be established: no answer
        print(f"error: {visible(bounded(str(exc)))}", file=sys.stderr)
        return 2
    if args.json:
        print(trail.to_json())
    else:
        print(visible(bounded(trail.verdict)))  # data: controls shown escaped, bounded
        print()
        print(trail.to_markdown())
    return 0 if trail.found else 1


def snapshot(args: argparse.Namespace) -> int:
    """``snapshot create|list|diff|retire``: training snapshots (core/snapshots/)."""
    import json

    from prx_assets.core.snapshots.manifest import SnapshotError
    from prx_assets.core.snapshots.runner import create_snapshot, list_snapshots, retire_snapshot
    from prx_assets.defs.resources import LabResource, default_data_root

    resource = LabResource(data_root=args.data_root or default_data_root())
    missing = _no_lab(resource)
    if missing:
        return missing
    lab = resource.lab()
    try:
        if args.action == "create":
            out = create_snapshot(
                lab, resource.shards_root, args.name, allow_empty=args.allow_empty
            )
            m = out.manifest
            verb = "created" if out.created else "exists (unchanged)"
            print(
                f"{m.snapshot_id}: {verb}; {len(m.directories)} directories, "
                f"{m.kept_samples} of {m.samples} samples in training; {out.path}"
            )
        elif args.action == "list":
            for s in list_snapshots(lab):
                print(
                    f"{s['snapshot_id']}\t{s['status']}\t{s['created_at'].isoformat()}\t"
                    f"{s['kept_samples']} samples\t{s['directories']} directories"
                )
        elif args.action == "diff":
            from prx_assets.core.snapshots.diff import diff_snapshots

            diff = diff_snapshots(lab, args.a, args.b)
            print(json.dumps(diff.as_dict(), indent=1) if args.json else diff.to_markdown())
        elif args.action == "retire":
            out = retire_snapshot(lab, resource.shards_root, args.name)
            print(
                f"{out.snapshot_id}: retired{' (already)' if out.already_retired else ''}; "
                f"{out.pins_removed} directory pins and {len(out.retained_removed)} retained "
                "copies released"
            )
    except (SnapshotError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


# ``prx-assets compliance`` exit status per verdict: 0 only when the list is applied and holding.
COMPLIANCE_EXIT = {"PASS": 0, "FAIL": 1, "PENDING": 3, "NOT APPLIED": 4}


def compliance(args: argparse.Namespace) -> int:
    """One opt-out list's verdict (first line: the word and why), its images and the snapshots
    holding them. Exit 0 only on PASS (applied and holding); 1 FAIL (a live snapshot made
    after it arrived holds one of its images), 3 PENDING (skip_lists has not applied it
    everywhere yet), 4 NOT APPLIED (rejected, or never taken in), 2 no lab or no answer
    (which snapshots hold its images cannot be established)."""
    import json

    from prx_assets.core.markdown import bounded, visible
    from prx_assets.core.snapshots.compliance import (
        NOT_APPLIED,
        ComplianceError,
        compliance_report,
    )
    from prx_assets.core.snapshots.manifest import SnapshotError
    from prx_assets.defs.resources import LabResource, default_data_root

    resource = LabResource(data_root=args.data_root or default_data_root())
    missing = _no_lab(resource)
    if missing:
        return missing
    try:
        report = compliance_report(resource.lab(), resource.shards_root, args.list)
    except ComplianceError as exc:
        print(f"{NOT_APPLIED}: {exc}: intake has not taken it in (no opt_out_lists row)")
        return COMPLIANCE_EXIT[NOT_APPLIED]
    except SnapshotError as exc:  # never a verdict it cannot back
        print(f"error: no verdict: {visible(bounded(str(exc)))}", file=sys.stderr)
        return 2
    print(
        json.dumps(report.as_dict(), indent=1, default=str) if args.json else report.to_markdown()
    )
    return COMPLIANCE_EXIT[report.verdict]


def _no_lab(resource) -> int:  # noqa: ANN001 - a LabResource (Dagster import kept lazy)
    """2 after saying "no lab at <path>" when the data root holds no lab; else 0.

    Checked before ``resource.lab()``, which would create an empty lab there and then answer
    "nothing" (an empty listing, "not found") as if the lab existed."""
    from prx_assets.core.lab import no_lab_at

    reason = no_lab_at(resource.lab_root)
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    return 0


def export(args: argparse.Namespace) -> int:
    """``export --out DIR``: the training samples as a plain MDS tree (loader/export.py)."""
    from prx_assets.core.skiplists.sidecars import SkipListError
    from prx_assets.defs.resources import default_data_root, lab_resource
    from prx_assets.loader.export import ExportError, export_training_samples

    root = args.root or lab_resource(args.data_root or default_data_root()).shards_root
    try:
        out = export_training_samples(
            root,
            args.out,
            tiers=args.tier or None,
            shapes=args.shape or None,
            batches=args.batch or None,
            cache_dir=args.cache_dir,
        )
    except (ExportError, SkipListError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{out.out}: {out.kept_samples} of {out.samples} samples (those the skip-lists keep) "
        f"from {len(out.directories)} directories of {root}, as plain MDS; opt-outs published "
        "later are not applied to this copy (see its export.json)"
    )
    return 0


def demo(args: argparse.Namespace) -> int:
    from prx_assets.demo.runner import run_demo

    return run_demo(Path(args.data_root), _instance(), size=args.size, verbose=args.verbose)


def make_buckets(args: argparse.Namespace) -> int:
    """Create the buckets the deployment's ``s3://`` URIs name (a deployment step: the
    platform itself never creates a bucket, it refuses a missing one)."""
    from prx_assets.core.storage import make_bucket

    uris = args.uri or [
        os.environ[v]
        for v in ("PRX_LANDING_URI", "PRX_LAB_URI", "PRX_SHARDS_URI")
        if os.environ.get(v, "").startswith("s3://")
    ]
    if not uris:
        print("no s3:// URI given nor in PRX_LANDING_URI / PRX_LAB_URI / PRX_SHARDS_URI")
        return 2
    for uri in uris:
        if not uri.startswith("s3://"):
            print(f"not an s3:// URI: {uri[:200]!r}")
            return 2
        created = make_bucket(uri)
        bucket = uri[len("s3://") :].split("/", 1)[0]
        print(f"{bucket}: {'created' if created else 'exists'}")
    return 0


DATA_ROOT_HELP = (
    "the data root holding landing/, lab/ and shards/ (default: $PRX_DATA_ROOT or data)"
)
JSON_HELP = "the same answer as JSON on stdout (exit codes unchanged)"
VERBOSE_HELP = "print every Dagster event of the runs (default: the steps' own lines and progress)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prx-assets", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="build the demo landing zone and materialise every stage")
    p.add_argument(
        "--data-root",
        default=os.environ.get("PRX_DATA_ROOT", "data"),
        help="where the demo builds its landing zone, lab and shards (default: $PRX_DATA_ROOT or data)",
    )
    p.add_argument(
        "--size",
        choices=("full", "small"),
        default="full",
        help="full: every bundled photo with 12 variants; small: 4 photos with 2 (a quick look)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=demo)
    p = sub.add_parser("register-batch", help="register one landing entry as a partition")
    p.add_argument("path", help="<landing>/<source>/<chunk> folder, archive or manifest")
    p.add_argument("--data-root", default=None, help=DATA_ROOT_HELP)
    p.add_argument(
        "--materialize",
        action="store_true",
        help="also run its stages now, then the dedup reruns other partitions need",
    )
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=register_batch)
    p = sub.add_parser("browser", help="the curation browser on 127.0.0.1", add_help=False)
    p.set_defaults(func=None)
    p = sub.add_parser("audit", help="one image's verdict and whole trail")
    p.add_argument(
        "query", help="content key, URL, source:id, <source>/<chunk>/<path> or path in batch"
    )
    p.add_argument("--data-root", default=None, help=DATA_ROOT_HELP)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=audit)
    p = sub.add_parser("snapshot", help="training snapshots: create, list, diff, retire")
    snap = p.add_subparsers(dest="action", required=True)
    for action, what in (
        ("create", "freeze what the loader trains on now under NAME"),
        ("retire", "release a snapshot's pinned files and Lance versions"),
    ):
        q = snap.add_parser(action, help=what)
        q.add_argument("name", help="the snapshot's name")
        q.add_argument("--data-root", default=None, help=DATA_ROOT_HELP)
        if action == "create":
            q.add_argument(
                "--allow-empty",
                action="store_true",
                help="freeze a training set with no sample in it (refused otherwise)",
            )
    q = snap.add_parser("list", help="every snapshot with its date, size and status")
    q.add_argument("--data-root", default=None, help=DATA_ROOT_HELP)
    q = snap.add_parser("diff", help="samples added/removed/changed from A to B, by reason")
    q.add_argument("a")
    q.add_argument("b")
    q.add_argument("--data-root", default=None, help=DATA_ROOT_HELP)
    q.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=snapshot)
    p = sub.add_parser("compliance", help="an opt-out list's images and the snapshots holding them")
    p.add_argument("list", help="list id, file name or path as recorded in opt_out_lists")
    p.add_argument("--data-root", default=None, help=DATA_ROOT_HELP)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=compliance)
    p = sub.add_parser(
        "export", help="the training samples (skip-lists applied) as a plain MDS tree"
    )
    p.add_argument("--out", required=True, help="new directory (never overwritten)")
    p.add_argument("--data-root", default=None, help=DATA_ROOT_HELP)
    p.add_argument("--root", default=None, help="shards root (default: the data root's)")
    p.add_argument("--cache-dir", default=None, help="local cache, for a URL root")
    p.add_argument("--tier", action="append", help="only this tier (repeatable)")
    p.add_argument("--shape", action="append", help="only this <H>x<W> (repeatable)")
    p.add_argument("--batch", action="append", help="only this batch (repeatable)")
    p.set_defaults(func=export)
    p = sub.add_parser(
        "make-buckets", help="create the buckets of s3:// URIs (default: the PRX_*_URI ones)"
    )
    p.add_argument("uri", nargs="*", help="s3://bucket[/prefix] (default: the PRX_*_URI)")
    p.set_defaults(func=make_buckets)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["browser"]:  # its own argument parser: python -m prx_assets.browser
        from prx_assets.browser.__main__ import main as browser_main

        return browser_main(argv[1:])
    args = parser.parse_args(argv)
    started = time.time()
    code = args.func(args)
    if args.command == "demo":
        print(f"\n(done in {time.time() - started:.0f} s)")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
