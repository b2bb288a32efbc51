"""Teams, their API keys, quotas and usage (E2B's model; docs/architecture.md "Teams").

A deployment has one admin key (AENV_API_KEY): it is the key of the ``default`` team and may
manage teams. Every other key belongs to one team and sees only that team's sandboxes, templates
and snapshots (plus public templates such as ``base``). Keys are kept as SHA-256 digests only.
"""
