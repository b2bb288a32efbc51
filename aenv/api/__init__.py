"""HTTP surface of a node: control plane, envd data plane, sandbox port proxy."""
