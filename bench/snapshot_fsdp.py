"""Pure FSDP's verified snapshot: what the second copy across the network costs per take.

Prints JSON. Four gloo ranks on CPU, one per emulated node, one thread each: four
``Linear(width, width)`` under ``fully_shard`` (each, then the root) over one mesh
dimension, Adam after one step (its moments exist). For ``snapshot_copies`` 1 (each rank
copies its own shards to host memory) and 2 (and sends them to the rank on the next node,
receiving that of the previous one, over the snapshot's own gloo group) it times
:meth:`Snapshot.take` ten times after a barrier: ``take_ms`` (median), the exchange's share
(``exchange_ms``, from ``Snapshot.exchange_seconds``), the host bytes each rank keeps
against one replica's state. HSDP needs no such copy (its replicas hold every shard).

    .venv/bin/python bench/snapshot_fsdp.py [--width 1536]   # 9.44 M parameters
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from sdc_agent.launch import spawn_local

TAKES = 10


def _rank(rank: int, world: int, width: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sdc_agent.snapshot import Snapshot
    from sdc_agent.topology import RankIdentity, Topology

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for block in net:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(4, width)).sum().backward()
    optimizer.step()
    topology = Topology(
        tuple(RankIdentity(rank=r, node=f"n{r}", local_rank=0, pod=None) for r in range(world))
    )
    out: dict[str, Any] = {}
    for copies in (1, 2):
        snapshot = Snapshot(
            module=net,
            optimizer=optimizer,
            topology=topology,
            group_rank=rank,
            group=None,
            comm_device=torch.device("cpu"),
            copies=copies,
            memory_fraction=0.9,
            write_seconds=10.0,
            directory=None,
            run_id="bench",
            shard_of=tuple(range(world)),
        )
        snapshot.take(0)  # buffers allocated
        snapshot.exchange_seconds = 0.0
        times = []
        for i in range(TAKES):
            dist.barrier()
            started = time.perf_counter()
            snapshot.take(i)
            times.append(time.perf_counter() - started)
        out[f"copies_{copies}"] = {
            "take_ms": round(statistics.median(times) * 1e3, 2),
            "exchange_ms": round(snapshot.exchange_seconds / TAKES * 1e3, 2),
            "bytes_per_rank": snapshot.bytes_per_rank(),
            "state_bytes": snapshot.state_bytes(),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1536)
    args = parser.parse_args()
    ranks = spawn_local(_rank, ["n0", "n1", "n2", "n3"], (args.width,))
    params = 4 * (args.width * args.width + args.width)
    print(json.dumps({"parameters": params, "ranks": ranks}, indent=1))


if __name__ == "__main__":
    main()
