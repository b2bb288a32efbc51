"""Many nodes as one service: the cluster store on etcd, its in-memory mirror, the node agent that
registers a node and writes its sandboxes' directory entries, and the gateway (docs/cluster.md)."""
