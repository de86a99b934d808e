"""The per-source usage-signal policy file: read from the data root, part of the skip policy's
fingerprint (so ``skip_lists`` alone goes stale), and refused, never defaulted, when broken."""

import json

import pytest

from prx_assets.definitions import build_defs
from prx_assets.defs.skiplists.config import USAGE_POLICY_FILENAME, SkipPolicyResource


def _skip_lists_version(data_root) -> dict[str, str | None]:
    """Asset -> code version, as the code location built on ``data_root`` declares them."""
    out = {}
    for a in build_defs(str(data_root)).assets or []:
        for key, version in getattr(a, "code_versions_by_key", {}).items():
            out[key.to_user_string()] = version
    return out


def test_the_policy_file_versions_skip_lists_only_and_a_broken_one_is_refused(tmp_path):
    base = _skip_lists_version(tmp_path)  # no file: every signal honoured
    policy = {"sources": {"laion": {"honour": ["tdm-reservation"], "malformed": "ignore"}}}
    (tmp_path / USAGE_POLICY_FILENAME).write_text(json.dumps(policy))
    switched = _skip_lists_version(tmp_path)
    assert {k for k in base if base[k] != switched[k]} == {"skip_lists"}
    resource = SkipPolicyResource(usage_policy_file=str(tmp_path / USAGE_POLICY_FILENAME))
    assert resource.policy().usage.rule_for_batch("laion.000").honour == {"tdm-reservation"}
    for broken in ("{", json.dumps({"sources": {"laion": {"honour": ["noai"]}}}), "[]"):
        (tmp_path / USAGE_POLICY_FILENAME).write_text(broken)
        with pytest.raises(ValueError, match="usage policy"):
            build_defs(str(tmp_path))
