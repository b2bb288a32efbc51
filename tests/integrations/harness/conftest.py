"""Tests that need the harnesses' heavier installs (mini-swe-agent, verl, Harbor): run by
`scripts/harness-suite` in its own virtualenvs, not collected by `./scripts/test`."""

import os

collect_ignore_glob = [] if os.environ.get("AENV_HARNESS_SUITE") else ["test_*.py"]
