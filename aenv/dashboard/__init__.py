"""The operator's web dashboard, served at /dashboard by a node and by a gateway (see docs/dashboard.md)."""
