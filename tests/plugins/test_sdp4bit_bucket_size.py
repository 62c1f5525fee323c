"""``bucket_size_mb="auto"``: the bucket count rule, the option, and a measurement every rank agrees on."""

import pytest
import torch

from lightning_sdp.plugins.sdp4bit import auto, bucket_size
from lightning_sdp.plugins.sdp4bit.bucket_size import MAX_BUCKETS, choose_bucket_count, measured_bucket_numel
from lightning_sdp.plugins.sdp4bit.config import SDP4BitConfig
from lightning_sdp.plugins.sdp4bit.formats import gradient_format
from lightning_sdp.plugins.sdp4bit.topology import build_topology
from tests._distributed import run_distributed


def test_bucket_count_minimises_exposed_wire_plus_bucket_cost():
    assert choose_bucket_count(0.0, 1e-3) == 1  # nothing on the wire: one bucket
    assert choose_bucket_count(1e-3, 2e-3) == 1  # a fast link (10 Gbit/s): the buckets' cost dominates
    assert choose_bucket_count(0.064, 4e-3) == 4
    assert choose_bucket_count(10.0, 1e-6) == MAX_BUCKETS and choose_bucket_count(1.0, 0.0) == MAX_BUCKETS
    for g, c in [(0.05, 1e-3), (0.2, 3e-3), (0.01, 2e-4)]:  # no other count has a smaller total
        best = choose_bucket_count(g, c)
        total = [g / b + c * b for b in range(1, MAX_BUCKETS + 1)]
        assert total[best - 1] <= min(total) * 1.05  # the rounded square root: at most a few percent off
    counts = [choose_bucket_count(g, 1e-3) for g in (1e-4, 1e-3, 1e-2, 1e-1, 1.0)]
    assert counts == sorted(counts)  # a slower link never gets fewer buckets


def test_auto_is_an_option_and_other_strings_are_not():
    assert SDP4BitConfig(bucket_size_mb="auto").bucket_numel is None
    with pytest.raises(ValueError, match="bucket_size_mb must be 'auto', a number or None"):
        SDP4BitConfig(bucket_size_mb="large")


def _measure(rank: int, world: int) -> tuple:
    topo = build_topology(rank, world, 2)
    formats = [gradient_format("tlq_hs", 8, 4, 32), gradient_format("none", 8, 4, 32)]
    numel, seen = measured_bucket_numel(topo, torch.device("cpu"), formats, 3_000_000, 2048, 128)
    topo.destroy()
    return numel, seen["buckets"], seen["gradient_seconds"], seen["bucket_seconds"]


def test_every_rank_gets_the_same_measured_bucket_size():
    results = run_distributed(_measure, 4, timeout=300)
    assert len({r[:2] for r in results}) == 1  # one answer, agreed across ranks
    numel, buckets, wire, cost = results[0]
    assert 1 <= buckets <= MAX_BUCKETS and wire > 0 and cost > 0
    assert numel >= 3_000_000 / buckets


def _probes_with_both_autos(rank: int, world: int) -> tuple:
    calls = []
    probe = auto.probe_links

    def counted(*args, **kwargs):
        calls.append(1)
        return probe(*args, **kwargs)

    auto.probe_links = bucket_size.probe_links = counted
    topo = build_topology(rank, world, 2)
    config = SDP4BitConfig(bucket_size_mb="auto")  # and "auto" formats, the default
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(300_000))])
    numel, words, links = bucket_size.bucket_numel(config, topo, torch.device("cpu"), [optimizer], config.alignment)
    controller = auto.build_auto(config, topo, [numel // world], 4, torch.device("cpu"), links=links)
    topo.destroy()
    return len(calls), controller.links is links, words is not None


def test_auto_buckets_and_auto_formats_probe_the_links_once():
    assert run_distributed(_probes_with_both_autos, 4, timeout=300) == [(1, True, True)] * 4
