"""Two "nodes" on one machine: ``torchrun --nnodes=2 --nproc-per-node=2`` started twice on loopback.

SDP4Bit's gradient exchange is hierarchical: 8-bit all-to-all among the processes of a node, 4-bit all-to-all
between nodes (the default compression, ``"auto"``, runs these formats first while it times its candidates). This
script shows that the strategy reads the topology from the launcher (processes per node and number of nodes)
without any ``intra_node_size`` override. Run from the repository root:

    .venv/bin/python examples/sdp4bit_two_nodes.py --launch

``--launch`` starts two ``torchrun`` agents (node ranks 0 and 1, rendezvous on 127.0.0.1), each running this file
as a 2-process "node"; every rank trains a small MLP for a few steps with ``Trainer(strategy="sdp4bit",
devices=2, num_nodes=2)`` and prints the topology it detected and the bits per element it sent. On a real
cluster, run the worker part on each machine with ``--master_addr`` of node 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def worker(steps: int) -> None:
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_sdp  # noqa: F401  (registers "sdp4bit")

    class MLP(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(512, 32, generator=g)
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)

    torch.set_num_threads(1)
    trainer = Trainer(
        strategy="sdp4bit", accelerator="cpu", devices=2, num_nodes=2, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(MLP())
    s = trainer.strategy
    report = {
        "rank": trainer.global_rank,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "environment": type(s.cluster_environment).__name__,
        "intra_node_size": s.topology.intra_size,
        "inter_node_size": s.topology.inter_size,
        "bits": {k: s.comm_stats.bits_per_element(k) for k in ("weight", "grad_intra", "grad_inter")},
    }
    print("SDP4BIT_TOPOLOGY " + json.dumps(report), flush=True)


def _parse_reports(output: str) -> list[dict]:
    """The JSON reports of the ranks (the two ranks of a node share stdout, so lines may interleave)."""
    decoder = json.JSONDecoder()
    marker = "SDP4BIT_TOPOLOGY "
    reports, pos = [], output.find(marker)
    while pos >= 0:
        report, end = decoder.raw_decode(output, pos + len(marker))
        reports.append(report)
        pos = output.find(marker, end)
    return reports


def launch(steps: int) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    common = ["--nnodes=2", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}"]
    script = [str(Path(__file__).resolve()), "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            torchrun + common + [f"--node-rank={n}"] + script,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for n in (0, 1)
    ]
    reports = []
    for n, agent in enumerate(agents):
        out, _ = agent.communicate(timeout=600)
        if agent.returncode:
            print(out)
            raise SystemExit(f"torchrun agent of node {n} failed with exit code {agent.returncode}")
        reports += _parse_reports(out)
    for r in sorted(reports, key=lambda r: r["rank"]):
        print(json.dumps(r))
    ok = len(reports) == 4 and all(r["intra_node_size"] == 2 and r["inter_node_size"] == 2 for r in reports)
    print("detected intra-node size 2 and inter-node size 2 on every rank" if ok else "UNEXPECTED TOPOLOGY")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launch", action="store_true", help="start the two torchrun agents on loopback")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.launch:
        raise SystemExit(launch(args.steps))
    worker(args.steps)


if __name__ == "__main__":
    main()
