"""The caption stage against a fleet of fake servers: does it keep them busy.

Fake servers: N processes on 127.0.0.1 (``--serve``, standard library only), each answering
``POST /v1/chat/completions`` after ``latency`` seconds with at most ``concurrency`` requests
served at once (more wait in its queue, as in a vLLM batch): fleet capacity = N x
concurrency / latency requests/s. A request with an image gets ``a caption for image
<sha256 of its data URL>`` and 120 words, one without gets ``visual`` (the classifier).

What runs is the real ``captions`` / ``caption_classes`` asset (``materialize`` on a real
Dagster instance and a real lab), with the ``openai`` backends pointed at the fleet. The
rate is the servers' own: answered requests / (last answer - first request), so Dagster's
fixed per-run cost does not count against the fleet; the asset's whole wall time is kept
beside it.

Scenarios:

- ``old_path`` / ``new_path``: the captioner alone in this process on the 3-4 MP photos,
  end to end (images / wall): the previous client (every image of a 256-image chunk
  prepared in turn, then the chunk sent and waited for, then the next) beside the stream;
- ``captions_photos``: the captions asset on real 3-4 MP JPEGs (made from the bundled
  photos by ``prx_assets/demo/jpegs.py``, as ``bench_pipeline``), fleet 80/s;
- ``captions_small`` / ``captions_max``: the same asset on the bundled photos shrunk to at
  most 256 px (the HTTP path itself), at 80/s and at the largest capacity simulated here;
- ``classes_80`` / ``classes_max``: the caption_classes asset against a text fleet;
- ``killed``: a server ``kill -9``-ed mid-run: every image must have exactly one caption,
  its own (checked against the digest of its own prepared image);
- ``captions_photos_pool``: the same with ``prepare_on="pool"``: images prepared on the
  per-image worker pool (processes here, Ray actors on a cluster), the step only streams;
- ``captions_photos_server``: ``resize="server"``: the ingested JPEG, metadata stripped, is
  sent as it is and the server's processor resizes it (``core/captions/models/passthrough``);
- ``prepare_cpu``: CPU (``time.process_time``) per image of the captioner's preparation
  (decode, resize to ``max_side``, JPEG, base64) on the 3-4 MP photos, one thread.

Client CPU per image: this process's CPU time over the asset run / images (the pool's
worker processes are not this process).

    python -m benchmarks.bench_caption_fleet [--quick]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "bench_caption_fleet.json"
BATCH = "fleet.000"
FILLER = ("soft window light falls across a wooden table with a white cup " * 12).split()[:114]


# --------------------------------------------------------------------------- fake server


def serve(port_file: str, latency: float, concurrency: int) -> None:
    """One fake OpenAI-compatible server (run in its own process)."""
    gate = threading.BoundedSemaphore(concurrency)
    lock = threading.Lock()
    stats = {"answered": 0, "first": None, "last": None}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def do_GET(self) -> None:  # noqa: N802
            with lock:
                payload = json.dumps(stats).encode()
                if self.path == "/reset":  # a new scenario on the same servers
                    stats.update(answered=0, first=None, last=None)
            self._send(payload)

        def do_POST(self) -> None:  # noqa: N802
            started = time.time()
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            url = None
            for msg in body.get("messages", []):
                if isinstance(msg.get("content"), list):
                    for part in msg["content"]:
                        if part.get("type") == "image_url":
                            url = part["image_url"]["url"]
            with gate:
                time.sleep(latency)
            if url is None:
                content = "visual"
            else:
                digest = hashlib.sha256(url.encode()).hexdigest()[:12]
                content = " ".join(["a", "caption", "for", "image", digest, *FILLER])
            choice = {"index": 0, "message": {"role": "assistant", "content": content}}
            self._send(json.dumps({"choices": [{**choice, "finish_reason": "stop"}]}).encode())
            with lock:
                stats["answered"] += 1
                stats["first"] = min(stats["first"] or started, started)
                stats["last"] = time.time()

        def _send(self, payload: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.request_queue_size = 256
    Path(port_file + ".tmp").write_text(str(server.server_address[1]))
    os.replace(port_file + ".tmp", port_file)
    server.serve_forever(0.05)


class Fleet:
    """N fake servers in their own processes; killed (SIGKILL) when the fleet ends."""

    def __init__(self, n: int, latency: float, concurrency: int, tmp: Path) -> None:
        self.latency, self.concurrency = latency, concurrency
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []
        for i in range(n):
            port_file = tmp / f"port-{time.monotonic_ns()}-{i}"
            cmd = [sys.executable, "-m", "benchmarks.bench_caption_fleet", "--serve"]
            cmd += [str(port_file), str(latency), str(concurrency)]
            self.procs.append(subprocess.Popen(cmd, cwd=Path(__file__).parent.parent))
            for _ in range(1000):
                if port_file.exists():
                    break
                time.sleep(0.01)
            self.ports.append(int(port_file.read_text()))

    @property
    def capacity(self) -> float:
        return len(self.procs) * self.concurrency / self.latency

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}/v1" for p in self.ports]

    def stats(self, path: str = "/") -> list[dict[str, Any]]:
        out = []
        for proc, url in zip(self.procs, self.urls, strict=True):
            if proc.poll() is not None:
                continue  # killed: its answers are counted by the client
            with urllib.request.urlopen(url.removesuffix("/v1") + path, timeout=5) as resp:
                out.append(json.loads(resp.read()))
        return out

    def reset(self) -> None:
        self.stats("/reset")

    def rate(self) -> float:
        stats = [s for s in self.stats() if s["answered"]]
        answered = sum(s["answered"] for s in stats)
        span = max(s["last"] for s in stats) - min(s["first"] for s in stats)
        return answered / span

    def kill(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# --------------------------------------------------------------------------- inputs and lab


def photos_3_4mp(n: int) -> list[bytes]:
    """``n`` distinct 3-4 MP JPEGs (q95) from the bundled photos, as bench_pipeline makes."""
    import numpy as np
    from PIL import Image

    from prx_assets.demo.jpegs import bundled_photos, crop_to_aspect, jpeg_bytes, mosaic

    aspects = (1.0, 1.5, 0.75, 4 / 3, 16 / 9, 0.6)
    photos, rng, out = bundled_photos(), np.random.default_rng(0), []
    for i in range(n):
        mp, aspect = float(rng.uniform(3.0, 4.0)), aspects[i % len(aspects)]
        w = round((mp * 1e6 * aspect) ** 0.5)
        h = round(w / aspect)
        if i % 3 == 2:
            img = mosaic((w, h), rng)
        else:
            img = crop_to_aspect(photos[i % len(photos)], aspect).resize((w, h), Image.LANCZOS)
        out.append(jpeg_bytes(img, quality=95))
    return out


def photos_small(n: int, side: int = 256) -> list[bytes]:
    """``n`` distinct small JPEGs: the bundled photos shrunk to ``side`` px, shifted crops."""
    from PIL import Image

    from prx_assets.demo.jpegs import bundled_photos, jpeg_bytes

    out = []
    for i in range(n):
        p = bundled_photos()[i % len(bundled_photos())]
        dx = (i // len(bundled_photos())) % 97
        img = p.crop((dx, 0, p.width, p.height)).copy()
        img.thumbnail((side, side), Image.BILINEAR)
        out.append(jpeg_bytes(img, quality=90))
    return out


def write_batch(lab: Any, images: list[bytes], alt: bool = True) -> list[str]:
    import pyarrow as pa

    from prx_assets.core.tables import IMAGES, RESOLUTION

    n = len(images)
    keys = [f"{i:06d}-" + hashlib.sha256(b).hexdigest()[:16] for i, b in enumerate(images)]
    cols = {
        "key": keys,
        "batch": [BATCH] * n,
        "alt_text": [f"a photograph number {i} of a table by a window" for i in range(n)],
        "width": pa.array([1024] * n, pa.int32()),
        "height": pa.array([768] * n, pa.int32()),
        "file_size": pa.array([len(b) for b in images], pa.int64()),
        "image": pa.array(images, pa.large_binary()),
    }
    full = pa.table(
        {f.name: cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in IMAGES.schema}
    )
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
    return keys


def client_concurrency(server_concurrency: int) -> int:
    return server_concurrency + max(2, server_concurrency // 2)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --------------------------------------------------------------------------- scenarios


def run_asset(
    tmp: Path,
    images: list[bytes],
    fleet: Fleet,
    asset: str,
    *,
    kill_after: float | None = None,
    verify: bool = False,
    resize: str = "lanczos",
    prepare_on: str = "threads",
) -> dict[str, Any]:
    """Materialise ``captions`` (or, on alt-text captions, ``caption_classes``) on ``fleet``."""
    from dagster import instance_for_test, materialize

    from prx_assets.core.captions.models import CaptionInput
    from prx_assets.defs.captions.assets import build_caption_assets
    from prx_assets.defs.captions.resources import (
        CaptionerResource,
        ClassifierResource,
        EmbedderResource,
    )
    from prx_assets.defs.partitions import BATCHES
    from prx_assets.defs.resources import LabResource

    root = Path(tempfile.mkdtemp(dir=tmp))
    lab_res = LabResource(data_root=str(root))
    keys = write_batch(lab_res.lab(), images)
    conc = fleet.concurrency
    # Keep each server's queue non-empty: more in flight than it serves at once (as one
    # would set a client against vLLM's max_num_seqs), else every answer leaves a slot idle
    # for a client round trip.
    client_conc = client_concurrency(conc)
    fleet_opts = {"base_urls": fleet.urls, "max_concurrency": client_conc}
    fleet_opts |= {"backoff_base_s": 0.05}
    fleet_opts |= {"circuit_cooldown_s": 1.0, "timeout_s": 30.0}
    if asset == "captions":
        captioner = CaptionerResource(
            backend="openai", model="fake-vlm", resize=resize, prepare_on=prepare_on, **fleet_opts
        )
        classifier = ClassifierResource()
    else:
        captioner = CaptionerResource()  # alt-text captions to classify
        classifier = ClassifierResource(
            backend="openai", model="fake-lm", mode="choice", **fleet_opts
        )
    assets = [
        a
        for a in build_caption_assets(captioner, classifier, EmbedderResource())
        if a.key.to_user_string() in ("captions", "caption_classes")
    ]
    quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
    res = {"lab": lab_res, "captioner": captioner, "classifier": classifier}
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(BATCHES.name, [BATCH])
        if asset != "captions":
            ok = materialize(
                assets, partition_key=BATCH, instance=instance, resources=res,
                selection=["captions"], run_config=quiet,
            )  # fmt: skip
            assert ok.success
        killer = None
        if kill_after is not None:
            killer = threading.Timer(kill_after, fleet.kill, args=(len(fleet.procs) - 1,))
            killer.start()
        fleet.reset()
        cpu0, t0 = cpu_s(), time.perf_counter()
        result = materialize(
            assets, partition_key=BATCH, instance=instance, resources=res,
            selection=[asset], run_config=quiet,
        )  # fmt: skip
        wall, cpu = time.perf_counter() - t0, cpu_s() - cpu0
        if killer is not None:
            killer.join()
        assert result.success, asset
    rate = fleet.rate() if kill_after is None else len(images) / wall
    out: dict[str, Any] = {
        "asset": asset,
        "images": len(images),
        "fleet_capacity_per_s": round(fleet.capacity, 1),
        "servers": len(fleet.procs),
        "latency_s": fleet.latency,
        "concurrency_per_server": conc,
        "client_max_concurrency_per_server": client_conc,
        "resize": resize if asset == "captions" else None,
        "prepare_on": prepare_on if asset == "captions" else None,
        "served_per_s": round(rate, 1),
        "pct_of_capacity": round(100 * rate / fleet.capacity, 1),
        "asset_wall_s": round(wall, 2),
        "asset_per_s": round(len(images) / wall, 1),
        "client_cpu_ms_per_image": round(1000 * cpu / len(images), 2),
    }
    if verify:
        from prx_assets.core.captions.models import OpenAICaptioner

        rows = lab_res.lab().read_batch("captions", BATCH, ["key", "caption"]).to_pylist()
        got = [r["key"] for r in rows]
        cap = OpenAICaptioner("fake-vlm", base_url=fleet.urls[0])
        wrong = 0
        by_key = dict(zip(keys, images, strict=True))
        for r in rows:
            url = cap.image_url(CaptionInput(r["key"], image=by_key[r["key"]]))
            digest = hashlib.sha256(url.encode()).hexdigest()[:12]
            wrong += not r["caption"].startswith(f"a caption for image {digest} ")
        out |= {
            "rows": len(rows),
            "lost": len(set(keys) - set(got)),
            "duplicated": len(got) - len(set(got)),
            "wrong_caption": wrong,
        }
    return out


def run_in_process(images: list[bytes], fleet: Fleet, *, streaming: bool) -> dict[str, Any]:
    """The captioner alone in this process (no Dagster, no lab), end to end: images / wall.

    ``streaming=False`` is the previous client: a 256-image chunk prepared image by image,
    then sent, then waited for, then the next chunk; ``True`` is ``caption_stream``.
    """
    from prx_assets.core.captions.models import CaptionInput, OpenAICaptioner

    conc = client_concurrency(fleet.concurrency)
    cap = OpenAICaptioner("fake-vlm", base_url=fleet.urls, max_concurrency=conc, timeout_s=30.0)
    items = [CaptionInput(f"k{i}", image=b) for i, b in enumerate(images)]
    fleet.reset()
    t0 = time.perf_counter()
    n = 0
    with cap:
        if streaming:
            n = sum(1 for _ in cap.caption_stream(items))
        else:
            for start in range(0, len(items), 256):
                jobs = [cap.prepare(it) for it in items[start : start + 256]]
                n += len(cap._client.map(cap._one, jobs))
    wall = time.perf_counter() - t0
    return {
        "images": n,
        "fleet_capacity_per_s": round(fleet.capacity, 1),
        "per_s": round(n / wall, 1),
        "pct_of_capacity": round(100 * n / wall / fleet.capacity, 1),
        "path": "caption_stream" if streaming else "prepare 256, send, wait (previous)",
    }


def prepare_cpu(images: list[bytes], resize: str) -> dict[str, Any]:
    from prx_assets.core.captions.models import CaptionInput, OpenAICaptioner

    cap = OpenAICaptioner("fake-vlm", base_url="http://127.0.0.1:9/v1", resize=resize)
    per, passed = [], 0
    for i, b in enumerate(images):
        t = time.process_time()
        key, url = cap.prepare(CaptionInput(f"k{i}", image=b))
        per.append(time.process_time() - t)
        sent = base64.b64decode(url[23:])
        assert url.startswith("data:image/jpeg;base64,") and sent
        passed += len(sent) > len(b) // 2  # the original (stripped), not a re-encode
    per.sort()
    return {
        "images": len(images),
        "passed_through": passed,
        "max_side": cap.max_side,
        "mean_ms": round(1000 * sum(per) / len(per), 1),
        "median_ms": round(1000 * per[len(per) // 2], 1),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-servers", type=int, default=4)
    parser.add_argument("--max-concurrency", type=int, default=10)
    parser.add_argument(
        "--max-latency",
        type=float,
        default=0.1,
        help="server latency of the largest fleet (0.1 s: 40 requests in flight for 400/s; "
        "the client's one thread per request in flight costs CPU on a small machine)",
    )
    args = parser.parse_args()
    q = args.quick
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
    n_big, n_old = (300, 64) if q else (1200, 256)
    n_small, n_max = (800, 2400) if q else (3200, 8000)
    out: dict[str, Any] = {"quick": q, "cpus": len(os.sched_getaffinity(0))}
    big = photos_3_4mp(48 if q else 96)
    small = photos_small(n_max)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out["prepare_cpu"] = prepare_cpu(big[:24], "lanczos")
        out["prepare_cpu_draft"] = prepare_cpu(big[:24], "draft")
        out["prepare_cpu_server"] = prepare_cpu(big[:24], "server")
        fleet = Fleet(3, 0.3, 8, tmp)  # 80/s, as in the issue
        try:
            photos = [big[i % len(big)] for i in range(n_big)]
            out["old_path"] = run_in_process(photos[:n_old], fleet, streaming=False)
            out["new_path"] = run_in_process(photos[:n_old], fleet, streaming=True)
            out["captions_photos"] = run_asset(tmp, photos, fleet, "captions")
            out["captions_photos_draft"] = run_asset(tmp, photos, fleet, "captions", resize="draft")
            out["captions_photos_server"] = run_asset(
                tmp, photos, fleet, "captions", resize="server"
            )
            out["captions_photos_pool"] = run_asset(
                tmp, photos, fleet, "captions", resize="draft", prepare_on="pool"
            )
        finally:
            fleet.close()
        for name, asset, n, servers, conc in (
            ("captions_small", "captions", n_small, 3, 8),
            ("classes_80", "caption_classes", n_small, 3, 8),
            ("captions_max", "captions", n_max, args.max_servers, args.max_concurrency),
            ("classes_max", "caption_classes", n_max, args.max_servers, args.max_concurrency),
        ):
            latency = args.max_latency if name.endswith("_max") else 0.3
            fleet = Fleet(servers, latency, conc, tmp)
            try:
                out[name] = run_asset(tmp, small[:n], fleet, asset)
            finally:
                fleet.close()
        fleet = Fleet(3, 0.3, 8, tmp)
        try:
            n = n_small
            out["killed"] = run_asset(
                tmp, small[:n], fleet, "captions", kill_after=0.4 * n / 80, verify=True
            )
        finally:
            fleet.close()

    cp, old, ph = out["prepare_cpu"], out["old_path"], out["captions_photos"]
    new = out["new_path"]
    cpd, phd = out["prepare_cpu_draft"], out["captions_photos_draft"]
    pool = out["captions_photos_pool"]
    cps, phs = out["prepare_cpu_server"], out["captions_photos_server"]
    cpus = out["cpus"]
    lines = [
        f"captions (3-4 MP photos, resize=server, fleet {phs['fleet_capacity_per_s']:g}/s): "
        f"{phs['pct_of_capacity']} % of fleet capacity (target >= 90 %; "
        f"{cps['passed_through']} of {cps['images']} photos passed through)",
        f"captions (3-4 MP photos, fleet {ph['fleet_capacity_per_s']:g}/s): "
        f"{ph['pct_of_capacity']} % of fleet capacity (target >= 90 %; preparation bound on "
        f"{cpus} cores: {cpus * 1000 / cp['mean_ms']:.0f}/s)",
        f"captions (3-4 MP photos, resize=draft, fleet {phd['fleet_capacity_per_s']:g}/s): "
        f"{phd['pct_of_capacity']} % of fleet capacity (target >= 90 %; preparation bound on "
        f"{cpus} cores: {cpus * 1000 / cpd['mean_ms']:.0f}/s)",
        f"captioner in process, same 3-4 MP photos and fleet: previous prepare-then-send "
        f"{old['per_s']}/s ({old['pct_of_capacity']} %), stream {new['per_s']}/s "
        f"({new['pct_of_capacity']} %)",
    ]
    for key, what in (
        ("captions_small", "captions (<=256 px photos"),
        ("captions_max", "captions (<=256 px photos"),
        ("classes_80", "caption_classes (text fleet"),
        ("classes_max", "caption_classes (text fleet"),
    ):
        r = out[key]
        lines.append(
            f"{what}, fleet {r['fleet_capacity_per_s']:g}/s = {r['servers']} x "
            f"{r['concurrency_per_server']} / {r['latency_s']:g} s): {r['pct_of_capacity']} % of "
            f"fleet capacity (target >= 90 %)"
        )
    lines += [
        f"preparation CPU per image (3-4 MP JPEG -> {cp['max_side']} px JPEG, one thread): "
        f"{cp['mean_ms']} ms lanczos, {cpd['mean_ms']} ms draft, {cps['mean_ms']} ms server "
        "(the ingested JPEG, metadata stripped, base64; target <= 10 ms)",
        f"caption step CPU per image on 3-4 MP photos (its process; target <= 10 ms): "
        f"{phs['client_cpu_ms_per_image']} ms with resize=server, "
        f"{ph['client_cpu_ms_per_image']} ms preparing on threads, "
        f"{pool['client_cpu_ms_per_image']} ms with prepare_on=pool "
        f"({pool['pct_of_capacity']} % of capacity: the pool's workers share these {cpus} "
        f"cores); on <=256 px photos: {out['captions_small']['client_cpu_ms_per_image']} ms",
        f"server killed mid-run: {out['killed']['lost']} lost, {out['killed']['duplicated']} "
        f"duplicated, {out['killed']['wrong_caption']} wrong of {out['killed']['images']} "
        f"(target 0, 0, 0)",
    ]
    out["summary"] = lines
    out["command"] = "python -m benchmarks.bench_caption_fleet" + (" --quick" if q else "")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "summary"}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
