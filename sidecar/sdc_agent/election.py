"""Who reports a verdict: a few nodes, chosen alike on every rank.

Every rank reaches the same verdict, so sending it from every node makes a job of 2,000
nodes send 2,000 copies at the same moment. The operator needs two nodes to agree; three
reporters leave one to spare. The choice is a pure function of the verdict's suspects,
the topology and the replay ring, so every rank computes it alike without a collective:

1. the nodes of the suspects' replay partners (the rank that replayed the suspect's work,
   then the rank whose work the suspect replayed), suspect by suspect;
2. then the other nodes that hold no suspect, in the order of their lowest rank;
3. the suspects' own nodes last: a node is never the only witness against itself, but on
   a job of two nodes it is one of the two.

A verdict without suspects (training, nondeterministic) comes from the first nodes.
Each chosen node sends through its local rank 0. Heartbeats are not elected: every node
sends its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["elect_reporters"]


def elect_reporters(
    suspects: Sequence[int],
    nodes: Sequence[str],
    replayer_of: Mapping[int, int],
    count: int,
) -> tuple[str, ...]:
    """The nodes that report a verdict naming ``suspects`` (group ranks).

    ``nodes[r]`` is group rank ``r``'s node; ``replayer_of`` is the replay ring
    (:func:`sdc_agent.replay.plan_ring`). ``count`` 0 means every node.
    """
    order = list(dict.fromkeys(nodes))
    if count <= 0 or count >= len(order):
        return tuple(order)
    partner_of = {r: p for p, r in replayer_of.items()}
    suspect_nodes = {nodes[s] for s in suspects}
    chosen: list[str] = []

    def take(node: str) -> None:
        if node not in chosen and len(chosen) < count:
            chosen.append(node)

    for s in sorted(suspects):
        for other in (replayer_of.get(s), partner_of.get(s)):
            if other is not None and nodes[other] not in suspect_nodes:
                take(nodes[other])
    for node in order:
        if node not in suspect_nodes:
            take(node)
    for node in order:
        take(node)
    return tuple(chosen)
