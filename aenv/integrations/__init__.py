"""Adapters that let RL harnesses run on aenv unchanged (docs/integrations.md).

- ``aenv.integrations.swerex``: a SWE-ReX deployment (``pip install 'aenv[swerex]'``)
- ``aenv.integrations.minisweagent``: a mini-swe-agent environment (``'aenv[minisweagent]'``)
- ``aenv.integrations.rllm``: an rLLM-style sandbox (no extra: rLLM is not on PyPI)
- ``aenv.integrations.fusion``: a SandboxFusion-compatible service for verl (``aenv fusion``)

Harbor needs none: its ``-e e2b`` environment drives aenv's E2B API as it is.
"""
