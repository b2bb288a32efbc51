"""Secrets: a team's values kept write-only and encrypted at rest (E2B's /secrets API)."""
