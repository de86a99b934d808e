"""Curation-browser query latency on a synthetic lab of one million captions.

Run from the repo root: ``python -m benchmarks.bench_browser [--quick] [--rows N]``
(``--quick``: 100,000 rows). Heavy at full size (about 2 GB on disk, minutes of index
building on two cores): run it once, not in a loop.

1. Build a lab with the real table schemas: ``images`` (no bytes), ``resolution``,
   ``captions`` (15-40 words drawn from a Zipf vocabulary of 5,000 made-up words),
   ``caption_classes`` (visual 90 % / text 8 % / nsfw 2 %) and ``caption_embeddings``
   (384-d float32 unit vectors: 2,000 random unit centres plus noise of norm ~0.75, so a
   caption's neighbours sit at cosine ~0.6-0.7 as related MiniLM captions do; plain random
   unit vectors have no neighbours at all), written in 100k-row chunks,
   in 100 batches and 5 sources. Then the indexes, timed: the INVERTED index on
   ``captions.caption``, a cosine IVF_PQ index on the vectors (the caption stage's
   ``ensure_embedding_index``) and the scalar indexes the tables' specs declare
   (``Lab.ensure_indexes``, as every stage write does).
2. Time queries through :class:`prx_assets.browser.queries.LabQueries`, the code the app
   runs (each includes reading the 60 result cards' details by key): full text, nearest
   neighbours, and filtered variants (batch prefilter, selective key-set prefilter, broad
   post-filter with widening, filtered listing). Median and p95 over ``--queries`` each.
3. Baselines side by side, alternating query by query in this process: each filtered query
   with scalar indexes off (``use_scalar_index=False``: Lance scans the filter columns),
   and nearest neighbours by brute force (``use_index=False``), with the index's recall@10.

Prints a table and writes ``benchmarks/results/bench_browser.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from prx_assets.browser.queries import (
    BROWSER_TABLES,
    EMBEDDINGS,
    Filters,
    LabQueries,
    index_report,
)
from prx_assets.core.captions.tables import ensure_caption_text_index, ensure_embedding_index
from prx_assets.core.lab import Lab, TableSpec
from prx_assets.core.tables import CAPTION_CLASSES, CAPTION_EMBEDDINGS, IMAGES, RESOLUTION
from prx_assets.core.tables import CAPTIONS as CAPTIONS_SPEC

RESULTS = Path(__file__).resolve().parent / "results" / "bench_browser.json"
CHUNK = 100_000
DIM = 384
VOCAB = 5_000
BATCHES = [f"synth.{i:03d}" for i in range(100)]
SOURCES = ["laion-like", "stock", "studio", "museum", "web"]
SOURCE_P = [0.5, 0.25, 0.15, 0.07, 0.03]
LABELS_P = {"visual": 0.90, "text": 0.08, "nsfw": 0.02}
CENTRES = 2_000
NOISE = 0.75 / DIM**0.5  # per dimension: the noise vector's norm is ~0.75


def vocabulary(rng: np.random.Generator) -> np.ndarray:
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words: set[str] = set()
    while len(words) < VOCAB:
        n = int(rng.integers(2, 4))
        words.add("".join(rng.choice(syllables, n)))
    return np.array(sorted(words))


def _nulls(spec: TableSpec, n: int, have: dict[str, Any]) -> pa.Table:
    cols = {}
    for f in spec.schema:
        cols[f.name] = have[f.name] if f.name in have else pa.nulls(n, f.type)
    return pa.table(cols, schema=spec.schema)


def _chunk_tables(
    rng: np.random.Generator, start: int, n: int, words: np.ndarray, centres: np.ndarray
) -> dict[str, pa.Table]:
    keys = [rng.bytes(32).hex() for _ in range(n)]
    batch = np.array(BATCHES)[rng.integers(0, len(BATCHES), n)]
    source = np.array(SOURCES)[rng.choice(len(SOURCES), n, p=SOURCE_P)]
    width = rng.integers(256, 4097, n).astype(np.int32)
    height = rng.integers(256, 4097, n).astype(np.int32)
    mp = width.astype(np.float64) * height / 1e6
    ranks = np.arange(1, VOCAB + 1)
    p = (1.0 / ranks) / (1.0 / ranks).sum()
    lengths = rng.integers(15, 41, n)
    idx = rng.choice(VOCAB, size=(n, 40), p=p)
    captions = [" ".join(words[row[:k]]) for row, k in zip(idx, lengths, strict=True)]
    labels = np.array(list(LABELS_P))[rng.choice(3, n, p=list(LABELS_P.values()))]
    centre = rng.integers(0, len(centres), n)
    vec = centres[centre] + rng.standard_normal((n, DIM), dtype=np.float32) * NOISE
    vec /= np.linalg.norm(vec, axis=1, keepdims=True)
    now = datetime.now(UTC)
    base = {"key": pa.array(keys), "batch": pa.array(batch)}
    return {
        IMAGES.name: _nulls(
            IMAGES,
            n,
            {**base, "source": pa.array(source), "width": width, "height": height},
        ),
        RESOLUTION.name: _nulls(
            RESOLUTION,
            n,
            {
                **base,
                "width": width,
                "height": height,
                "megapixels": mp,
                "eligible": pa.array(np.ones(n, bool)),
            },
        ),
        CAPTIONS_SPEC.name: _nulls(
            CAPTIONS_SPEC,
            n,
            {
                **base,
                "caption": pa.array(captions),
                "word_count": pa.array(lengths.astype(np.int32)),
                "backend": pa.array(["synthetic"] * n),
            },
        ),
        CAPTION_CLASSES.name: _nulls(CAPTION_CLASSES, n, {**base, "label": pa.array(labels)}),
        CAPTION_EMBEDDINGS.name: _nulls(
            CAPTION_EMBEDDINGS,
            n,
            {
                **base,
                "vector": pa.FixedSizeListArray.from_arrays(pa.array(vec.reshape(-1)), DIM),
                "created_at": pa.array([now] * n, pa.timestamp("us", tz="UTC")),
            },
        ),
    }


def build_lab(root: Path, rows: int, seed: int = 0) -> tuple[Lab, dict[str, float], np.ndarray]:
    rng = np.random.default_rng(seed)
    words = vocabulary(rng)
    centres = rng.standard_normal((CENTRES, DIM), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    lab = Lab(root)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    for start in range(0, rows, CHUNK):
        n = min(CHUNK, rows - start)
        for name, table in _chunk_tables(rng, start, n, words, centres).items():
            mode = "create" if start == 0 else "append"
            lance.write_dataset(table, lab.uri(name), mode=mode, max_rows_per_file=CHUNK)
        print(f"  wrote {start + n:,}/{rows:,} rows", flush=True)
    timings["write_tables_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert ensure_caption_text_index(lab) == "created"
    timings["fts_index_s"] = time.perf_counter() - t0
    print(f"  FTS index {timings['fts_index_s']:.1f} s", flush=True)
    t0 = time.perf_counter()
    assert ensure_embedding_index(lab, min_rows=256, index_type="IVF_PQ") == "created"
    timings["vector_index_s"] = time.perf_counter() - t0
    print(f"  IVF_PQ index {timings['vector_index_s']:.1f} s", flush=True)
    t0 = time.perf_counter()
    for spec in BROWSER_TABLES:
        lab.ensure_indexes(spec)
    timings["scalar_indexes_s"] = time.perf_counter() - t0
    report = index_report(lab.view())
    bad = {k: v for k, v in report.items() if v not in ("present", "absent table")}
    if bad:
        raise RuntimeError(f"index build failed: {bad}")
    print(f"  scalar indexes {timings['scalar_indexes_s']:.1f} s", flush=True)
    return lab, timings, words


def _stats(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return {"median_ms": statistics.median(ordered), "p95_ms": p95, "n": len(ordered)}


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1000, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100,000 rows")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--queries", type=int, default=50, help="timed queries per kind")
    parser.add_argument("--baseline-queries", type=int, default=10, help="per baseline kind")
    parser.add_argument("--workdir", default=None, help="where to build the lab (removed after)")
    parser.add_argument(
        "--lab", default=None, help="keep the synthetic lab here and reuse it when present"
    )
    args = parser.parse_args()
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    if args.lab:
        lab, build, words = _kept_lab(Path(args.lab), rows)
        results = run_queries(lab, words, args.queries, args.baseline_queries)
    else:
        work = Path(tempfile.mkdtemp(prefix="bench-browser-", dir=args.workdir))
        print(f"building a synthetic lab of {rows:,} rows in {work}", flush=True)
        try:
            lab, build, words = build_lab(work / "lab", rows)
            results = run_queries(lab, words, args.queries, args.baseline_queries)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    out = {
        "benchmark": "bench_browser",
        "quick": rows < 1_000_000,
        "rows": rows,
        "machine": {
            "python": platform.python_version(),
            "cpus": _cpus(),
            "lance": lance.__version__,
        },
        "build": build,
        "peak_rss_gb": round(peak_gb, 2),
        **results,
    }
    _print(out)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")
    return 0


def _kept_lab(path: Path, rows: int) -> tuple[Lab, dict[str, float], np.ndarray]:
    """Reuse a lab an earlier run built at ``path`` (same rows), or build and keep one."""
    stamp = path / "build.json"
    if stamp.exists() and json.loads(stamp.read_text())["rows"] == rows:
        print(f"reusing the synthetic lab in {path}", flush=True)
        build = {**json.loads(stamp.read_text())["build"], "reused_lab": True}
        return Lab(path / "lab"), build, vocabulary(np.random.default_rng(0))
    shutil.rmtree(path, ignore_errors=True)
    print(f"building a synthetic lab of {rows:,} rows in {path}", flush=True)
    lab, build, words = build_lab(path / "lab", rows)
    stamp.write_text(json.dumps({"rows": rows, "build": build}))
    return lab, build, words


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def run_queries(lab: Lab, words: np.ndarray, n: int, n_base: int) -> dict[str, Any]:
    """Time every query kind; baselines alternate with the indexed runs query by query."""
    rng = np.random.default_rng(1)
    q = LabQueries(lab, refresh_s=3600)
    scan = LabQueries(lab, refresh_s=3600, use_scalar_index=False)
    exact = LabQueries(lab, refresh_s=3600, use_vector_index=False)
    keys = lance.dataset(lab.uri(EMBEDDINGS)).take(
        rng.choice(lance.dataset(lab.uri(EMBEDDINGS)).count_rows(), 200, replace=False).tolist(),
        columns=["key"],
    )
    sample_keys = keys.column("key").to_pylist()

    def word(lo: int = 50, hi: int = 1000) -> str:
        # words[r - 1] was drawn with p ~ 1/r: mid ranks give realistic hit counts.
        return str(words[int(rng.integers(lo, hi))])

    def batch() -> str:
        return BATCHES[int(rng.integers(0, len(BATCHES)))]

    def key() -> str:
        return sample_keys[int(rng.integers(0, len(sample_keys)))]

    # Warm-up: open datasets, load index metadata (what the first request of the app pays).
    q.search(word(), limit=60)
    q.similar(key(), limit=60)
    q.browse(Filters(labels=("nsfw",)), limit=60)

    kinds: dict[str, Callable[[LabQueries], Any]] = {
        "fts 1 word": lambda lq: lq.search(word(), limit=60),
        "fts 2 words (all)": lambda lq: lq.search(f"{word(20, 200)} {word(20, 200)}", limit=60),
        "ann": lambda lq: lq.similar(key(), limit=60),
    }
    filtered: dict[str, Callable[[], tuple[str, Filters, str | None]]] = {
        # (mode, filters, text or key)
        "fts + batch (prefilter)": lambda: ("search", Filters(batches=(batch(),)), word()),
        "fts + nsfw in batch (key-set prefilter)": lambda: (
            "search",
            Filters(labels=("nsfw",), batches=(batch(),)),
            word(10, 100),
        ),
        "fts + text, short side >= 1024 (post-filter)": lambda: (
            "search",
            Filters(labels=("text",), min_short_side=1024),
            word(),
        ),
        "ann + batch (prefilter)": lambda: ("similar", Filters(batches=(batch(),)), key()),
        "ann + nsfw (post-filter)": lambda: ("similar", Filters(labels=("nsfw",)), key()),
        "browse nsfw, >= 2 MP, in batch": lambda: (
            "browse",
            Filters(labels=("nsfw",), min_megapixels=2.0, batches=(batch(),)),
            None,
        ),
        "browse stock, short side >= 3000": lambda: (
            "browse",
            Filters(sources=("stock",), min_short_side=3000),
            None,
        ),
    }

    def run(lq: LabQueries, mode: str, f: Filters, arg: str | None) -> Any:
        if mode == "search":
            return lq.search(arg or "", f, limit=60)
        if mode == "similar":
            return lq.similar(arg or "", f, limit=60)
        return lq.browse(f, limit=60)

    out: dict[str, Any] = {"queries": {}, "filtered_vs_scan": {}}
    for name, fn in kinds.items():
        ms, hits = [], []
        for _ in range(n):
            t, res = _timed(lambda fn=fn: fn(q))
            ms.append(t)
            hits.append(len(res.hits))
        out["queries"][name] = {**_stats(ms), "mean_hits": float(np.mean(hits))}
        print(f"  {name}: {out['queries'][name]['median_ms']:.1f} ms median", flush=True)

    for name, make in filtered.items():
        ms, hits, base_ms, speed = [], [], [], []
        for i in range(n):
            mode, f, arg = make()
            t, res = _timed(lambda mode=mode, f=f, arg=arg: run(q, mode, f, arg))
            ms.append(t)
            hits.append(len(res.hits))
            if i < n_base:  # the same query without scalar indexes, right after
                tb, base = _timed(lambda mode=mode, f=f, arg=arg: run(scan, mode, f, arg))
                base_ms.append(tb)
                if _answer(base) != _answer(res):
                    raise AssertionError(f"{name}: the scan baseline answered differently")
                speed.append(tb / t)
        entry = {**_stats(ms), "mean_hits": float(np.mean(hits))}
        out["queries"][name] = entry
        out["filtered_vs_scan"][name] = {
            "scan": _stats(base_ms),
            "paired_ratio_median": statistics.median(speed),
        }
        print(
            f"  {name}: {entry['median_ms']:.1f} ms median; scan x{statistics.median(speed):.1f}",
            flush=True,
        )

    # Nearest neighbours: IVF_PQ vs brute force, and the recall it buys the speed with.
    recalls, idx_ms, bf_ms = [], [], []
    for _ in range(n_base):
        k = key()
        t1, approx = _timed(lambda k=k: q.similar(k, limit=10))
        t2, truth = _timed(lambda k=k: exact.similar(k, limit=10))
        idx_ms.append(t1)
        bf_ms.append(t2)
        a = {h["key"] for h in approx.hits}
        recalls.append(len(a & {h["key"] for h in truth.hits}) / max(1, len(truth.hits)))
    out["ann_vs_brute_force"] = {
        "index": _stats(idx_ms),
        "brute_force": _stats(bf_ms),
        "ratio_median": statistics.median(bf_ms) / statistics.median(idx_ms),
        "recall_at_10": float(np.mean(recalls)),
        "nprobes": q.nprobes,
        "refine_factor": q.refine_factor,
    }
    return out


def _answer(result: Any) -> tuple:
    """What must agree between indexed and scan runs (tie order may differ)."""
    scores = [round(h.get("score", h.get("distance", 0.0)), 4) for h in result.hits]
    return len(result.hits), sorted(scores)


def _print(out: dict[str, Any]) -> None:
    b = out["build"]
    print(f"\nbench_browser: {out['rows']:,} rows, lance {out['machine']['lance']}, ", end="")
    print(f"{out['machine']['cpus']} CPUs, peak RSS {out['peak_rss_gb']} GB")
    print(
        f"build: write {b['write_tables_s']:.1f} s, FTS {b['fts_index_s']:.1f} s, "
        f"IVF_PQ {b['vector_index_s']:.1f} s, scalar {b['scalar_indexes_s']:.1f} s"
        + (" (timed when --lab first built it)" if b.get("reused_lab") else "")
    )
    print(f"\n{'query':48} {'median ms':>10} {'p95 ms':>8} {'hits':>6} {'scan/index':>11}")
    for name, s in out["queries"].items():
        ratio = out["filtered_vs_scan"].get(name, {}).get("paired_ratio_median")
        r = f"x{ratio:.1f}" if ratio else "-"
        print(f"{name:48} {s['median_ms']:10.1f} {s['p95_ms']:8.1f} {s['mean_hits']:6.0f} {r:>11}")
    a = out["ann_vs_brute_force"]
    print(
        f"\nANN top-10: index {a['index']['median_ms']:.1f} ms vs brute force "
        f"{a['brute_force']['median_ms']:.1f} ms (x{a['ratio_median']:.1f}), "
        f"recall@10 {a['recall_at_10']:.2f} (nprobes {a['nprobes']}, "
        f"refine_factor {a['refine_factor']})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
