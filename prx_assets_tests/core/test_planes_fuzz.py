"""The JPEG planes extension under AddressSanitizer and UBSan: thousands of truncated,
corrupt-marker, huge-dimension and odd-subsampling JPEGs, each rendered or refused with the
extension's ValueError (a per-image rejection for the shard path), never a memory error.

The extension is compiled a second time from the same source with the sanitizers
(``planes_fuzz.build_sanitized``) and the cases run in a child Python with libasan
preloaded (see ``planes_fuzz``). Where the sanitizer build or runtime cannot be had, these
tests fail with the reason: a fuzz run that silently checked nothing would read as a pass.
``make fuzz`` runs many more cases (``benchmarks/fuzz_planes.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prx_assets_tests.core import planes_fuzz

CASES = 4000  # ~3k mutated; a few seconds in the child on this machine


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("planes-asan")
    try:
        planes_fuzz.check_sanitizers_catch(directory)
        return planes_fuzz.build_sanitized(directory)
    except planes_fuzz.SanitizerUnavailable as exc:
        pytest.fail(f"no sanitizer build of _planes.c here, so nothing was fuzzed: {exc}")


def test_the_sanitizers_report_deliberate_errors(tmp_path: Path) -> None:
    # What makes a clean run mean something: built and run as the fuzz cases are, a 1-byte
    # heap overflow and a signed overflow each kill the child with a report.
    reports = planes_fuzz.check_sanitizers_catch(tmp_path)
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in reports[0]
    assert "runtime error: signed integer overflow" in reports[1]


def test_every_case_renders_or_is_rejected_cleanly(sanitized: Path) -> None:
    (run,) = planes_fuzz.run_fuzz(sanitized, CASES, seed=0, timeout=600)
    assert run.returncode == 0 and not run.sanitizer_reports, run.explain()
    s = run.summary
    assert s["cases"] == CASES and s["violation_count"] == 0, run.explain()
    outcomes = s["outcomes"]
    assert set(outcomes) <= {
        f"{group}:{outcome}"
        for group in ("pillow", "simplejpeg", "dc", "huge", "mutated")
        for outcome in ("rendered", "rejected")
    }, run.explain()
    # Real encoders' files all render (4:1:1 and 4:4:0 included), huge headers are all
    # refused on the header (checked per case against the message), and the mutations reach
    # both ends: the resampler and encoder run on damaged files that still decode.
    assert outcomes["pillow:rendered"] + outcomes["simplejpeg:rendered"] == 96, run.explain()
    assert outcomes["huge:rejected"] == 30, run.explain()
    assert outcomes["mutated:rendered"] > 100 and outcomes["mutated:rejected"] > 1000, json.dumps(s)


_KERNEL_SWEEP = """
plane = bytes(range(256)) * 40
for up in (1, 2, 3, 4):
    for n in (1, 2, 3, 7, 25):
        for out in range(1, 4 * n + 12):
            for box in ((0, out), (out // 3, out)):
                planes.resample(plane, n, 5, float(n), 5.0, out, 5, (box[0], 0, box[1], 5),
                                upsample=(up, 1))
                planes.resample(plane, 5, n, 5.0, float(n), 5, out, (0, box[0], 5, box[1]),
                                upsample=(1, up), simd=False)
print("swept")
"""


def test_chroma_kernels_stay_inside_their_weights_for_every_upsampling(sanitized: Path) -> None:
    # Regression: make_kernel sized a folded kernel's weights for 2x upsampling only; 3x and
    # 4x (a 4:1:1 JPEG's chroma: libjpeg-turbo's own 4:1:1 files, simplejpeg's "411") wrote
    # past them (found by the fuzz run above: heap-buffer-overflow in make_kernel).
    done = planes_fuzz.run_sanitized(sanitized, _KERNEL_SWEEP)
    assert done.returncode == 0 and "swept" in done.stdout, done.stderr[-6000:]


_RENDER_411 = """
import random
import numpy as np
import simplejpeg
from prx_assets.core.shards import resize
from prx_assets_tests.core import planes_fuzz
img = np.asarray(planes_fuzz._crop(1, (203, 151)))
for sub in ("411", "440"):
    data = simplejpeg.encode_jpeg(img, 88, "RGB", sub)
    for i in range(40):
        planes_fuzz._render(planes, resize, data, random.Random(i))
print("rendered")
"""


def test_a_411_jpeg_renders_through_the_shard_path(sanitized: Path) -> None:
    # Regression, end to end: decode, resample_planes, encode on 4:1:1 (and 4:4:0) files.
    done = planes_fuzz.run_sanitized(sanitized, _RENDER_411)
    assert done.returncode == 0 and "rendered" in done.stdout, done.stderr[-6000:]
