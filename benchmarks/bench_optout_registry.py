"""A registry-size opt-out list taken in by the real intake, in bounded memory.

What runs: a lab whose ``images`` table holds ``--lab`` images (default 10^6, in 100
partitions written through ``Lab.replace_partition``, the production indexes), and a
synthetic registry dump of ``--registry`` identifiers (default 10^7) as a txt list: a
third content keys, a third URLs, a third ``source:id`` pairs, 2 % of them naming lab
images, the rest naming nothing (real registries mostly name images a lab never held).
``ListIntake.run()`` takes it in, in a fresh process (its peak RSS is that process'
``VmHWM``, so nothing the benchmark itself holds counts), streaming in chunks of
``DEFAULT_CHUNK_ENTRIES``. Then a delta of ``--delta`` identifiers (default 10^5) is taken
in the same way: a delta of additions is just another list, so its cost follows the delta.

Then the opt-out sensor's tick once the lists are recorded (``plan_opt_out_tick`` in a
fresh process, every list new to its cursor): what the daemon's time limit applies to.

Checked, not assumed: the matched images equal the number the generator planted, and for a
random sample of 1,000 registry identifiers the ``opt_outs`` rows give exactly the images a
brute-force match (every ``images`` row read into memory, compared by ``pyarrow.compute``)
gives.

Baseline, side by side: parsing the same file into identifiers and nothing else
(``ListReader``), so the ratio says what resolution and writing add to reading the list.
A list a tenth of the registry's size is taken in too, against the same lab, so the peak
memory of the two (and of the delta) says whether memory follows the list; each intake's
peak is also read just before its one commit (the streaming part; Lance's index upkeep over
the list's new rows comes after it).

    python -m benchmarks.bench_optout_registry [--quick]

``--quick``: 10^6 identifiers against 10^5 images, a 10^4 delta (the full run's scale is
what the results file quotes). ``--lab``/``--registry``/``--delta`` run other sizes and write
``bench_optout_registry.lab<N>-reg<N>-delta<N>.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "bench_optout_registry.json"
QUICK_RESULTS = Path(__file__).parent / "results" / "bench_optout_registry.quick.json"
TARGET_PEAK_MB = 2048
MATCH_SHARE = 0.02
PARTITIONS = 100
SAMPLE = 1_000


def image_key(i: int) -> str:
    return hashlib.sha256(b"img%d" % i).hexdigest()


def image_url(i: int) -> str:
    return f"https://img.example.org/a/{i}.jpg"


def build_lab(root: Path, n: int) -> None:
    """``images`` rows for ``n`` images (identifiers only; the rest null), 100 batches."""
    import pyarrow as pa

    from prx_assets.core.lab import Lab
    from prx_assets.core.tables import IMAGES, PHASH_CLUSTERS

    lab = Lab(root)
    per = n // PARTITIONS
    for p in range(PARTITIONS):
        ids = range(p * per, (p + 1) * per)
        batch = f"web-{p:03d}"
        cols = {
            "key": [image_key(i) for i in ids],
            "batch": [batch] * per,
            "source": ["web"] * per,
            "url": [image_url(i) for i in ids],
            "source_id": [str(i) for i in ids],
        }
        arrays = [
            pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(per, f.type)
            for f in IMAGES.schema
        ]
        lab.replace_partition(IMAGES, batch, pa.Table.from_arrays(arrays, schema=IMAGES.schema))
        # Decided pHash clusters: every image its own, but 1 in 100 shares one with the next
        # image (the opt-out sensor widens what a list names to every copy).
        cluster = [f"c{i - 1 if i % 100 == 1 else i}" for i in ids]
        ccols = {
            "key": cols["key"],
            "batch": cols["batch"],
            "cluster_id": cluster,
            "low_information": [False] * per,
        }
        carrays = [
            pa.array(ccols[f.name], f.type) if f.name in ccols else pa.nulls(per, f.type)
            for f in PHASH_CLUSTERS.schema
        ]
        lab.replace_partition(
            PHASH_CLUSTERS, batch, pa.Table.from_arrays(carrays, schema=PHASH_CLUSTERS.schema)
        )
    lab.ensure_indexes(IMAGES)


def write_registry(path: Path, n: int, lab_n: int, seed: int, start: int) -> int:
    """A txt registry of ``n`` identifiers (``start``: where its absent ones are numbered,
    so a delta names other absent images); returns the lab images it names."""
    rng = np.random.default_rng(seed)
    hits = rng.random(n) < MATCH_SHARE
    targets = rng.integers(0, lab_n - lab_n % PARTITIONS, size=n)
    named: set[int] = set()
    with open(path, "w") as fh:
        lines = []
        for j in range(n):
            kind = j % 3
            i = int(targets[j]) if hits[j] else lab_n + start + j
            if hits[j]:
                named.add(i)
            if kind == 0:
                lines.append(image_key(i))
            elif kind == 1:
                lines.append(image_url(i))
            else:
                lines.append(f"web:{i}")
            if len(lines) >= 100_000:
                fh.write("\n".join(lines) + "\n")
                lines = []
        fh.write("\n".join(lines) + ("\n" if lines else ""))
    return len(named)


def peak_rss_kb() -> int:
    """Peak RSS of this process alone (``VmHWM``: its memory map's high-water mark). Not
    ``ru_maxrss``: Linux carries that across ``exec`` from the forking parent, so a child of
    a parent holding 500 MB would report at least that."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(lab_root: str, directory: str, list_id: str, mode: str) -> None:
    """Run in a fresh process: the intake (or the parse-only baseline); prints JSON."""
    from prx_assets.core.lab import Lab
    from prx_assets.core.skiplists.intake import ListIntake, find_list_file
    from prx_assets.core.skiplists.optouts import ListReader

    c, w = time.process_time(), time.perf_counter()
    if mode == "reach":  # the opt-out sensor's next tick once the lists are recorded
        from prx_assets.core.skiplists.reruns import OptOutCursor, plan_opt_out_tick

        registered = {f"web-{p:03d}" for p in range(PARTITIONS)}
        tick = plan_opt_out_tick(Lab(lab_root), Path(directory), OptOutCursor(), 8, registered)
        out: dict[str, Any] = {
            "batches": len(tick.skip_lists) + len(tick.waiting),  # reached (no shards here)
            "lists": len(tick.recorded),
        }
    elif mode == "parse":
        item = find_list_file(directory, list_id)
        n = 0
        with ListReader(item.path) as reader:
            for entry in reader.entries():
                n += entry.identifier is not None
            reader.digest()
        out = {"identifiers": n}
    else:
        from prx_assets.core.lab import store

        streamed: dict[str, float] = {}
        commit = store.Lab.commit_rows

        def noted(self: Any, *args: Any, **kwargs: Any) -> int:
            # The peak of the streaming part: everything before the list's one commit (whose
            # index upkeep over the list's new rows comes after).
            streamed.setdefault("peak_mb", peak_rss_kb() / 1024)
            return commit(self, *args, **kwargs)

        store.Lab.commit_rows = noted  # measurement only: the intake runs unchanged
        res = ListIntake(Lab(lab_root), directory, list_id, now=datetime.now(UTC)).run()
        out = {
            "status": res.status,
            "reason": res.reason,
            "identifiers": res.identifiers,
            "matched_images": res.matched_images,
            "batches": len(res.batches),
            "streaming_peak_rss_mb": round(streamed.get("peak_mb", 0.0), 1),
        }
    out["cpu_s"] = round(time.process_time() - c, 2)
    out["wall_s"] = round(time.perf_counter() - w, 2)
    out["peak_rss_mb"] = round(peak_rss_kb() / 1024, 1)
    print(json.dumps(out))


def in_child(lab_root: Path, directory: Path, list_id: str, mode: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_optout_registry", "--child", mode]
    cmd += [str(lab_root), str(directory), list_id]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{mode} child failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def brute_force_check(lab_root: Path, path: Path, list_id: str, seed: int) -> dict[str, Any]:
    """Sampled identifiers: the ``opt_outs`` rows against every ``images`` row compared."""
    import pyarrow.compute as pc

    from prx_assets.core.lab import Lab, in_list, sql_literal
    from prx_assets.core.skiplists.identifiers import parse_identifier

    with open(path) as fh:
        total = sum(1 for _ in fh)
    rng = np.random.default_rng(seed)
    picked = {int(i) for i in rng.choice(total, SAMPLE, replace=False)}
    with open(path) as fh:  # streamed: the registry is never held
        sample = [parse_identifier(ln) for n, ln in enumerate(fh) if n in picked]
    lab = Lab(lab_root)
    images = lab.read("images", ["batch", "key", "url", "source", "source_id"])
    sid = pc.binary_join_element_wise(images["source"], images["source_id"], ":")
    expected: set[tuple[str, str, str]] = set()
    for ident in sample:
        column = {"key": images["key"], "url": images["url"], "source_id": sid}[ident.kind]
        mask = pc.equal(column, ident.value)
        for r in images.filter(mask).select(["batch", "key"]).to_pylist():
            expected.add((ident.value, r["batch"], r["key"]))
    values = sorted({i.value for i in sample})
    rows = lab.read(
        "opt_outs",
        ["identifier", "matched_batch", "matched_key"],
        f"list_id = {sql_literal(list_id)} AND {in_list('identifier', values)}",
    ).to_pylist()
    got = {
        (r["identifier"], r["matched_batch"], r["matched_key"]) for r in rows if r["matched_key"]
    }
    named = {r["identifier"] for r in rows}
    return {
        "sampled": len(sample),
        "sampled_matches": len(expected),
        "exact": got == expected and named == set(values),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lab", type=int)
    parser.add_argument("--registry", type=int)
    parser.add_argument("--delta", type=int)
    parser.add_argument("--child", nargs=4, metavar=("MODE", "LAB", "DIR", "LIST"))
    args = parser.parse_args()
    if args.child:
        mode, lab_root, directory, list_id = args.child
        child(lab_root, directory, list_id, mode)
        return
    from prx_assets.core.skiplists.intake import DEFAULT_CHUNK_ENTRIES
    from prx_assets.core.skiplists.optouts import file_sha256, make_list_id

    lab_n = args.lab or (10**5 if args.quick else 10**6)
    reg_n = args.registry or (10**6 if args.quick else 10**7)
    delta_n = args.delta or (10**4 if args.quick else 10**5)
    out: dict[str, Any] = {
        "quick": args.quick,
        "cpus": len(os.sched_getaffinity(0)),
        "lab_images": lab_n,
        "registry_identifiers": reg_n,
        "delta_identifiers": delta_n,
        "chunk_entries": DEFAULT_CHUNK_ENTRIES,
    }
    with tempfile.TemporaryDirectory() as d:
        root, drop = Path(d) / "lab", Path(d) / "optouts"
        drop.mkdir()
        t = time.perf_counter()
        build_lab(root, lab_n)
        out["lab_build_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        registry = drop / "registry-dump.txt"
        planted = write_registry(registry, reg_n, lab_n, seed=1, start=0)
        delta = drop / "registry-delta-0001.txt"
        planted_delta = write_registry(delta, delta_n, lab_n, seed=2, start=reg_n)
        out["registry_bytes"] = registry.stat().st_size
        out["registry_write_s"] = round(time.perf_counter() - t, 1)
        tenth = drop / "registry-tenth.txt"  # memory at a tenth of the size: flat?
        write_registry(tenth, reg_n // 10, lab_n, seed=4, start=2 * reg_n)
        ids = {p: make_list_id(p.name, file_sha256(p)) for p in (registry, delta, tenth)}
        parse = in_child(root, drop, ids[registry], "parse")
        small = in_child(root, drop, ids[tenth], "intake")
        full = in_child(root, drop, ids[registry], "intake")
        inc = in_child(root, drop, ids[delta], "intake")
        reach = in_child(root, drop, ids[registry], "reach")
        check = brute_force_check(root, registry, ids[registry], seed=3)
    for name, res in (
        ("parse_only", parse),
        ("registry", full),
        ("tenth", small),
        ("delta", inc),
        ("sensor_reach", reach),
    ):
        out[name] = res
    out["planted_matches"] = planted
    out["planted_delta_matches"] = planted_delta
    out["check"] = check
    ok = (
        full["status"] == "accepted"
        and full["matched_images"] == planted
        and inc["matched_images"] == planted_delta
        and check["exact"]
    )
    per_id_us = full["wall_s"] / reg_n * 1e6
    delta_us = inc["wall_s"] / delta_n * 1e6
    lines = [
        f"registry intake: {reg_n:,} identifiers vs {lab_n:,} images in {full['wall_s']:.1f} s "
        f"({per_id_us:.1f} us/identifier; {full['wall_s'] / parse['wall_s']:.2f}x parsing it "
        f"alone, {parse['wall_s']:.1f} s)",
        f"registry intake peak memory: {full['peak_rss_mb']:,.0f} MB "
        f"(target <= {TARGET_PEAK_MB:,} MB; {small['peak_rss_mb']:,.0f} MB for a list of "
        f"{reg_n // 10:,}, {inc['peak_rss_mb']:,.0f} MB for the delta; before the commit's "
        f"index upkeep: {full['streaming_peak_rss_mb']:,.0f} / "
        f"{small['streaming_peak_rss_mb']:,.0f} / {inc['streaming_peak_rss_mb']:,.0f} MB)",
        f"matches: {full['matched_images']:,} images (planted {planted:,}); sampled "
        f"{check['sampled']:,} identifiers ({check['sampled_matches']} matches) exact against "
        f"brute force: {'yes' if check['exact'] else 'NO'}",
        f"delta: {delta_n:,} identifiers in {inc['wall_s']:.1f} s ({delta_us:.1f} us/identifier,"
        f" {inc['matched_images']:,} matched, planted {planted_delta:,}); peak "
        f"{inc['peak_rss_mb']:,.0f} MB",
        f"opt-out sensor's tick once the {reach['lists']} lists are recorded (their reach "
        f"through the pHash clusters computed by each intake run): {reach['wall_s']:.2f} s, "
        f"{reach['batches']} batches reached, peak {reach['peak_rss_mb']:,.0f} MB",
        f"verdict: {'PASS' if ok and full['peak_rss_mb'] <= TARGET_PEAK_MB else 'FAIL'}",
    ]
    out["summary"] = lines
    custom = args.lab or args.registry or args.delta
    out["command"] = "python -m benchmarks.bench_optout_registry" + (
        " --quick" if args.quick else ""
    )
    target = QUICK_RESULTS if args.quick else RESULTS
    if custom:  # its own file, named by its sizes, never the default run's
        out["command"] += f" --lab {lab_n} --registry {reg_n} --delta {delta_n}"
        target = RESULTS.with_name(
            f"bench_optout_registry.lab{lab_n}-reg{reg_n}-delta{delta_n}.json"
        )
    target.parent.mkdir(exist_ok=True)
    target.write_text(json.dumps(out, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
