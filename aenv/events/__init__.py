"""Lifecycle events of sandboxes and the webhooks that deliver them (E2B's /events API)."""
