"""The node agent: a node's membership in the cluster and its sandboxes' directory entries.

``aenv server --cluster`` starts one (:func:`start_agent`). Its parts: ``membership`` (the
:class:`NodeAgent`: register, heartbeat, the tick, refusals, the drain), ``directory`` (this node's
sandboxes' entries), ``takeover`` (durable takeovers), ``create_claims`` (create ids across
nodes), ``joining`` (a node's id, address and store from its settings) and ``node_app`` (the
node's app wrapped for the agent). Everything others use is imported from here.
"""

from __future__ import annotations

from aenv.cluster.agent.joining import advertise_of, cluster_store, join_cluster, node_id_of
from aenv.cluster.agent.membership import NodeAgent, start_agent
from aenv.cluster.agent.node_app import OWNERSHIP_PATH, leaving_with, refusing_without_quorum

__all__ = [
    "OWNERSHIP_PATH",
    "NodeAgent",
    "advertise_of",
    "cluster_store",
    "join_cluster",
    "leaving_with",
    "node_id_of",
    "refusing_without_quorum",
    "start_agent",
]
