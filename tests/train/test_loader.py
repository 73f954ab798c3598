"""The streaming loader on real Zarr stores: held-out split, epoch coverage, exact
resume from any position, cropping, only the needed layers, corrupt shards."""

from __future__ import annotations

from collections import Counter
from functools import partial

import builders
import numpy as np
import pytest
import torch

from store_schema import CorruptShardError, Store
from train.data.config import DataConfig
from train.data.heldout import is_heldout
from train.data.loader import LoaderSpec, ShardLoader
from train.families.dflash.anchors import has_anchor

HELDOUT = 0.25


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader") / "store"
    _, shards = builders.random_store(path, num_shards=5, samples_per_shard=6, layer_ids=(1, 3), num_target_layers=6)
    return Store(path), shards


def make_loader(store, layers=(1, 3), seed=3, epochs=2, position=None, log=print, lane=0, lanes=1, **data):
    """A loader over `store`; `data` overrides fields of the DataConfig below."""
    config = DataConfig(
        **{**dict(max_length=512, heldout_fraction=HELDOUT, buffer_shards=2, prefetch_samples=3), **data}
    )
    return ShardLoader(
        store,
        config,
        LoaderSpec(list(layers), partial(has_anchor, 8), seed=seed, epochs=epochs, lane=lane, lanes=lanes),
        position=position,
        log=log,
    )


def test_heldout_never_trained_on_and_each_train_sample_once_per_epoch(store):
    store, shards = store
    all_ids = {s.sample_id for samples in shards.values() for s in samples}
    heldout = {i for i in all_ids if is_heldout(i, HELDOUT)}
    assert 0 < len(heldout) < len(all_ids)

    delivered = list(make_loader(store))
    by_epoch = {e: [s.sample_id for s in delivered if s.epoch == e] for e in (0, 1)}
    for epoch, ids in by_epoch.items():
        assert Counter(ids) == Counter(all_ids - heldout), f"epoch {epoch}"
    assert by_epoch[0] != by_epoch[1]  # reshuffled every epoch
    assert {s.sample_id for s in make_loader(store).heldout_samples()} == heldout


def test_heldout_split_is_a_stable_hash():
    assert [is_heldout(f"id-{i}", 0.1) for i in range(200)] == [is_heldout(f"id-{i}", 0.1) for i in range(200)]
    share = np.mean([is_heldout(f"sample-{i}", 0.1) for i in range(20000)])
    assert 0.09 < share < 0.11
    assert not any(is_heldout(f"id-{i}", 0.0) for i in range(200))


def test_resume_from_any_position_continues_exactly(store):
    store, _ = store
    full = list(make_loader(store))
    for k in (1, 5, 11, len(full) // 2, len(full) - 1):
        rest = list(make_loader(store, position=full[k - 1].position))
        assert [s.sample_id for s in rest] == [s.sample_id for s in full[k:]], f"resumed after sample {k}"
        assert torch.equal(rest[0].features[0], full[k].features[0])


def test_lanes_split_each_epoch_without_overlap_and_resume_exactly(store):
    """Two lanes over 5 shards: the shards dealt 3 + 2 once for the run, each lane reading
    the same shards every epoch; together they deliver exactly the single stream's
    samples; a lane resumes exactly."""
    store, _ = store
    single = list(make_loader(store))
    lanes = [list(make_loader(store, lane=j, lanes=2)) for j in (0, 1)]
    for epoch in (0, 1):
        shards = [{s.shard for s in lane if s.epoch == epoch} for lane in lanes]
        assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 5
        assert shards == [{s.shard for s in lane if s.epoch == 0} for lane in lanes]  # the deal stays
        ids = [[s.sample_id for s in lane if s.epoch == epoch] for lane in lanes]
        assert Counter(ids[0] + ids[1]) == Counter(s.sample_id for s in single if s.epoch == epoch)
    loader = make_loader(store, lane=1, lanes=2)
    assert [sorted(loader.lane_shards(e)) for e in (0, 1)] == [sorted(loader.lane_shards(0))] * 2
    assert loader.lane_shards(0) != loader.lane_shards(1) and len(loader.lane_shards(0)) == 2  # reordered, 3 + 2
    assert sum(loader.lane_totals()) == len(single)
    k = len(lanes[1]) // 2
    rest = list(make_loader(store, lane=1, lanes=2, position=lanes[1][k - 1].position))
    assert [s.sample_id for s in rest] == [s.sample_id for s in lanes[1][k:]]
    with pytest.raises(
        ValueError, match="data.lanes: 6 lanes .* need at least as many shards; .* has 5: .*--shard-tokens"
    ):
        make_loader(store, lane=0, lanes=6)


def test_seed_changes_the_order(store):
    store, _ = store
    a = [s.sample_id for s in make_loader(store, epochs=1)]
    b = [s.sample_id for s in make_loader(store, epochs=1, seed=4)]
    assert sorted(a) == sorted(b) and a != b


def test_crops_from_the_start_and_reads_only_asked_layers(store):
    store, shards = store
    stored = {s.sample_id: s for samples in shards.values() for s in samples}
    samples = list(make_loader(store, layers=[3], max_length=50, epochs=1))
    assert samples
    for sample in samples:
        original = stored[sample.sample_id]
        n = min(50, len(original.input_ids))
        assert sample.num_tokens == n
        assert np.array_equal(sample.input_ids.numpy(), original.input_ids[:n])
        assert np.array_equal(sample.loss_mask.numpy(), original.loss_mask[:n])
        assert len(sample.features) == 1
        assert torch.equal(sample.features[0], original.hidden[3][:n])
        assert sample.context_features().shape == (n, 64)
    # read whole shards, but only layer 3's file
    assert set(store.read_shard(store.committed_shards()[0], layers=[3]).hidden) == {3}


def test_sample_without_anchor_is_not_delivered(tmp_path):
    _, shards = builders.random_store(tmp_path / "s", num_shards=1, samples_per_shard=4, num_target_layers=6)
    store = Store(tmp_path / "s")
    # block 200 > every sample's length (< 160): no valid anchor anywhere
    loader = ShardLoader(
        store, DataConfig(heldout_fraction=0.0), LoaderSpec([1], partial(has_anchor, 200), seed=0, epochs=1)
    )
    assert list(loader) == [] and loader.skipped_empty == 4


def _corrupt(store: Store, shard: str) -> None:
    chunk = store.path / "shards" / shard / "layer_1" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 0xFF
    chunk.write_bytes(bytes(data))


def test_corrupt_shard_is_refused_or_skipped_and_logged(tmp_path):
    _, shards = builders.random_store(tmp_path / "s", num_shards=4, samples_per_shard=5, num_target_layers=6)
    store = Store(tmp_path / "s")
    bad = store.committed_shards()[2]
    _corrupt(store, bad)

    with pytest.raises(CorruptShardError, match=f"shard {bad}: layer_1.*skip_corrupt_shards"):
        list(make_loader(store, epochs=1, heldout_fraction=0.0))

    messages = []
    loader = make_loader(store, epochs=2, heldout_fraction=0.0, skip_corrupt_shards=True, log=messages.append)
    delivered = [s.sample_id for s in loader]
    bad_ids = {s.sample_id for s in shards[bad]}
    good_ids = {s.sample_id for name, samples in shards.items() if name != bad for s in samples}
    assert not bad_ids & set(delivered)
    assert Counter(delivered) == Counter({i: 2 for i in good_ids})
    assert loader.skipped_shards == [bad]
    assert [m for m in messages if bad in m and "skipping corrupt shard" in m] == [messages[0]]  # once, not per epoch
    assert len(messages) == 1


def test_heldout_samples_read_only_their_rows_through_an_index_kept_for_the_run(tmp_path):
    """The bug: held-out samples were found by reading shards from the first one
    on (322 shards per evaluator per evaluation on the 902K plan). Now an index
    built once from the plan names their shards and rows, and only those rows
    are read: every shard without a held-out sample is wrecked here (each of its
    files overwritten), and held-out evaluation does not notice."""
    _, shards = builders.random_store(tmp_path / "s", num_shards=10, samples_per_shard=4, num_target_layers=6)
    store = Store(tmp_path / "s")
    fraction = 0.1
    held = {name: [s for s in samples if is_heldout(s.sample_id, fraction)] for name, samples in shards.items()}
    assert any(held.values()) and not all(held.values())
    for name in (n for n, samples in held.items() if not samples):
        for path in (store.path / "shards" / name).rglob("*"):
            if path.is_file() and path.name != "commit.json":
                path.write_bytes(b"\0" * path.stat().st_size)

    loader = make_loader(store, heldout_fraction=fraction)
    got = list(loader.heldout_samples())
    expected = [s for name in sorted(held) for s in held[name]]
    assert [s.sample_id for s in got] == [s.sample_id for s in expected]
    for sample, original in zip(got, expected):  # the rows read are the sample's own
        assert torch.equal(sample.input_ids, torch.from_numpy(original.input_ids).long())
        assert torch.equal(sample.features[1], original.hidden[3])
    assert [s.sample_id for s in loader.heldout_samples(2)] == [s.sample_id for s in expected[:2]]

    # The index is kept for the run: without the plan, a new loader falls back to
    # reading every shard's ids (and meets the wrecked ones); this one does not.
    (store.path / "plan" / "commit.json").unlink()
    assert [s.sample_id for s in loader.heldout_samples()] == [s.sample_id for s in expected]
    with pytest.raises(CorruptShardError):
        list(make_loader(Store(store.path), heldout_fraction=fraction).heldout_samples())


def test_heldout_index_without_a_plan_reads_each_shards_ids(tmp_path):
    _, shards = builders.random_store(
        tmp_path / "s", num_shards=3, samples_per_shard=6, num_target_layers=6, with_plan=False
    )
    store = Store(tmp_path / "s")
    assert store.plan() is None
    expected = [s.sample_id for name in sorted(shards) for s in shards[name] if is_heldout(s.sample_id, HELDOUT)]
    assert [s.sample_id for s in make_loader(store).heldout_samples()] == expected


def test_decode_threads_default_to_the_cores_available(store):
    from store_schema.runtime.host import available_cores
    from train.config_error import ConfigError
    from train.config_loading import load_config

    assert DataConfig().loader_threads is None  # the loader then decodes on available_cores() threads
    assert available_cores() >= 1
    store, _ = store
    assert len(list(make_loader(store, epochs=1))) > 0
    with pytest.raises(ConfigError, match="data.loader_threads"):
        load_config(None, ["data.loader_threads=0"], store="s", target="t", out="o")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_samples_reach_the_gpu_ahead_through_pinned_async_copies(store):
    """With a CUDA device the delivery thread copies each sample's features there
    (pinned memory, side stream) before the trainer asks; the features are the ones
    the CPU loader delivers, and waiting on the copy is the consumer's stream's."""
    store, _ = store
    config = DataConfig(max_length=512, heldout_fraction=HELDOUT, buffer_shards=2, prefetch_samples=3)
    on_gpu = ShardLoader(store, config, LoaderSpec([1, 3], partial(has_anchor, 8), seed=3, epochs=1, device="cuda"))
    on_cpu = ShardLoader(store, config, LoaderSpec([1, 3], partial(has_anchor, 8), seed=3, epochs=1))
    for gpu, cpu in zip(on_gpu, on_cpu, strict=True):
        assert gpu.sample_id == cpu.sample_id and gpu.ready is not None
        assert all(f.is_cuda for f in gpu.features)
        features = gpu.context_features("cuda")
        assert features.is_cuda and torch.equal(features.cpu(), cpu.context_features())


def test_the_sample_order_is_pure_arithmetic_without_a_store_or_threads():
    """`SampleOrder` alone: the lanes of an epoch partition its shard order (the shards
    dealt to lanes once, 4 + 3, the same in every epoch), groups cover each lane's shards, and walking
    `next_position` through every group visits each of its samples once and then
    moves to the next epoch."""
    from train.data.order import LoaderPosition, SampleOrder

    names = [f"shard-{i:06d}" for i in range(7)]
    lanes = [SampleOrder(list(reversed(names)), seed=5, buffer_shards=2, lane=j, lanes=2) for j in range(2)]
    for epoch in range(3):
        order = lanes[0].epoch_order(epoch)
        assert sorted(order) == names and order == lanes[1].epoch_order(epoch)
        shares = [lane.lane_shards(epoch) for lane in lanes]
        assert sorted(shares[0] + shares[1]) == names and len(shares[0]) == 4
        assert shares[0] == [name for name in order if name in lanes[0].lane_shards(0)]  # same shards, epoch's order
        assert [n for group in lanes[0].groups(epoch) for n in group] == shares[0]
    assert lanes[0].epoch_order(0) != lanes[0].epoch_order(1)
    assert sorted(lanes[0].group_permutation(0, 1, 9)) == list(range(9))
    lane, sizes, visited = lanes[1], [3, 2], []
    position = LoaderPosition(0, 0, 0)
    while position.epoch == 0:
        visited.append(position)
        position = lane.next_position(position, sizes[position.group])
    assert visited == [LoaderPosition(0, g, k) for g in range(lane.num_groups(0)) for k in range(sizes[g])]
    assert position == LoaderPosition(1, 0, 0)
    counts = {name: 2.0 for name in names}
    assert lanes[0].lane_totals(counts, 2) == [16.0, 12.0]  # 4 and 3 shards a lane, in each of the two epochs
