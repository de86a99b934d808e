"""Run tags the project's sensors and commands set, so a run says why it was started."""

TRIGGER_TAG = "prx/trigger"
"""What requested the run: ``dedup``, ``opt_out``, ``skip_policy``, ``skip_dirty``, ``swap``..."""
