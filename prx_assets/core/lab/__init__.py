"""The Lance "lab": the only package that imports Lance.

``store`` holds ``Lab`` (writes, reads, maintenance entry points, pins), ``view`` the
read views, ``blobs`` the content-addressed store for image bytes (``blob_gc`` collects
the blobs no retained version names), ``maintenance`` the
policy that keeps every operation's cost independent of the number of batches, ``spec``
what a table is. Import from here; the module split is an implementation detail.
"""

from prx_assets.core.lab.blobs import BlobError, BlobUnavailable
from prx_assets.core.lab.maintenance import (
    DEFAULT_POLICY,
    MANUAL,
    ORPHAN_MIN_AGE,
    ORPHAN_SCAN_LIMIT,
    TARGET_ROWS_PER_FRAGMENT,
    VERSION_PINS,
    MaintenancePolicy,
)
from prx_assets.core.lab.spec import TableSpec, in_list, sql_literal
from prx_assets.core.lab.store import Lab, no_lab_at
from prx_assets.core.lab.view import LabView, TableAt, full_text_query

__all__ = [
    "DEFAULT_POLICY",
    "MANUAL",
    "ORPHAN_MIN_AGE",
    "ORPHAN_SCAN_LIMIT",
    "TARGET_ROWS_PER_FRAGMENT",
    "VERSION_PINS",
    "BlobError",
    "BlobUnavailable",
    "Lab",
    "LabView",
    "MaintenancePolicy",
    "TableAt",
    "TableSpec",
    "full_text_query",
    "in_list",
    "no_lab_at",
    "sql_literal",
]
