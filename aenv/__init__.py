"""aenv: a self-hosted agent execution environment for large-scale agentic RL.

This package root stays import-free: the guest agent imports it inside sandboxes, where only
the standard library exists.
"""

__version__ = "0.1.0"
