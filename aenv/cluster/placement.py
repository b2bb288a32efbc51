"""Where a create goes: E2B's placement, plus what one gateway knows before the directory does.

E2B's API samples 3 ready nodes and takes the least loaded by
``(requested + allocated + in-flight CPU + half the used CPU) / (4 x cores)``. Here:

- *allocated* is the node's committed CPU (its running and starting sandboxes' limits, from its
  entry, rewritten every second); *used* the CPU its sandboxes used at their last sample (not the
  host's load: nodes may share a host); *requested* and each create *in flight* count as much
  as the node's sandboxes do on average (``CREATE_CPU`` on an empty node: the template's own
  size is the node's to know);
- *in flight* is what this gateway sent the node that its entry does not show yet: creates not
  answered and creates answered since the node's entry was last rewritten (at most
  ``ANSWERED_MEMORY`` seconds), less those the entry shows starting (not counted twice).
  Counted on the gateway's own clock and by the entries it received: nodes' clocks are never
  compared with it;
- a node that holds the template or snapshot on its disk (``NodeEntry.cached``) is preferred: one
  that would fetch it first counts ``UNCACHED`` more, as loaded as by one more core per core. The
  sample takes up to 3 nodes that hold it and up to 3 that do not, so a node holding it is never
  left out by chance.
- a durable pause taken over, or woken, elsewhere goes to a node running the runtime (runsc and
  platform) that wrote its memory image, when one has room: another one refuses the image (422).
"""

from __future__ import annotations

import random
import time
from collections import Counter

from aenv.cluster.entries import NodeEntry

SAMPLE = 3  # nodes drawn at random from each group (holding the source or not)
CREATE_CPU = 1.0  # cores a create counts for on a node without sandboxes (AENV_CPU_COUNT's default)
ANSWERED_MEMORY = 3.0  # seconds an answered create counts at most (entries are rewritten every second)
UNCACHED = 0.25  # of the score's scale (4 x cores): one more core per core


class Placement:
    def __init__(self) -> None:
        self.in_flight: Counter[str] = Counter()  # node id -> creates sent, not answered
        # node id -> (the node's entry when a create made there was answered, when)
        self.answered: dict[str, list[tuple[NodeEntry | None, float]]] = {}

    def sent(self, node_id: str) -> None:
        self.in_flight[node_id] += 1

    def done(self, node_id: str, *, made: bool, entry: NodeEntry | None) -> None:
        """A create answered; ``made`` when it made a sandbox, which counts until the node's
        entry (``entry`` is the one the gateway holds now) is rewritten."""
        self.in_flight[node_id] -= 1
        if self.in_flight[node_id] <= 0:
            del self.in_flight[node_id]
        if made:
            self.answered.setdefault(node_id, []).append((entry, time.monotonic()))

    def pending(self, node: NodeEntry) -> int:
        """Creates on ``node`` that its entry does not show yet."""
        now = time.monotonic()
        recent: list[tuple[NodeEntry | None, float]] = [
            (e, t) for e, t in self.answered.get(node.node_id, []) if e is node and now - t < ANSWERED_MEMORY
        ]
        if recent:
            self.answered[node.node_id] = recent
        else:
            self.answered.pop(node.node_id, None)
        return max(self.in_flight[node.node_id] + len(recent) - node.starting, 0)

    def score(self, node: NodeEntry, source: str | None = None) -> float:
        live = node.running + node.starting
        per_create = node.cpu_committed / live if live else CREATE_CPU  # as its sandboxes, on average
        cpu = per_create * (1 + self.pending(node)) + node.cpu_committed + node.cpu_used / 2
        score = cpu / (4 * max(node.cpu_count, 1.0))
        if source is not None and source not in node.cached:
            score += UNCACHED
        return score

    def rank(self, nodes: list[NodeEntry], source: str | None = None, runtime: str = "") -> list[NodeEntry]:
        """A sample of the ready nodes with room, best first (ties broken at random); with
        ``runtime``, only nodes running it while any of them has room."""
        ready = [n for n in nodes if not n.draining and n.room - self.pending(n) > 0]
        if runtime:
            ready = [n for n in ready if n.runtime == runtime] or ready
        holding = [n for n in ready if source is not None and source in n.cached]
        others = [n for n in ready if source is None or source not in n.cached]
        sample = random.sample(holding, min(SAMPLE, len(holding))) + random.sample(others, min(SAMPLE, len(others)))
        return sorted(sample, key=lambda n: (self.score(n, source), random.random()))
