import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loadopt.loaders.sampler import EpochOrder, ShardWindows
from loadopt.storage.sources.shards import ShardTable

from .backends import delay_loader

orders = st.fixed_dictionaries({
    "num_samples": st.integers(1, 500), "world_size": st.integers(1, 8), "seed": st.integers(0, 2**31),
    "epoch": st.integers(0, 1000), "batch_size": st.integers(1, 40), "shuffle": st.booleans(),
    "drop_last": st.booleans()})


def _window(p, shard_samples, window_shards):
    table = ShardTable.blocks(p["num_samples"], shard_samples)
    return {**p, "shuffle": "window", "windows": ShardWindows(table, window_shards)}


window_orders = st.builds(_window, orders, st.integers(1, 60), st.integers(1, 5))


@given(st.one_of(orders, window_orders))
@settings(max_examples=300, deadline=None)
def test_every_rank_the_same_batches_and_every_sample_once_but_the_stated_padding(p):
    """The equal-batches rule (loaders/sampler.py): same batch count on every rank; without drop_last every
    sample at least once and at most world_size - 1 of them twice; with drop_last none twice and fewer than
    world_size x (batch_size + 1) left out."""
    seen, counts, padded = [], set(), 0
    for rank in range(p["world_size"]):
        order = EpochOrder(rank=rank, **p)
        batches = order.batches()
        assert len(batches) == len(order)
        counts.add(len(order))
        assert all(0 < len(b) <= p["batch_size"] for b in batches)
        assert not p["drop_last"] or all(len(b) == p["batch_size"] for b in batches)
        seen.extend(np.concatenate(batches).tolist() if batches else [])
        padded += order.padding()
    assert len(counts) == 1
    n, world = p["num_samples"], p["world_size"]
    distinct = set(seen)
    assert len(seen) - len(distinct) == padded
    if p["drop_last"]:
        assert padded == 0 and n - len(distinct) < world * (p["batch_size"] + 1)
    else:
        assert distinct == set(range(n)) and padded <= world - 1
    if world == 1:
        assert padded == 0 and (p["drop_last"] or sorted(seen) == list(range(n)))


@given(st.one_of(orders, window_orders), st.data())
@settings(max_examples=200, deadline=None)
def test_resume_gives_exactly_the_remaining_batches(p, data):
    rank = data.draw(st.integers(0, p["world_size"] - 1))
    order = EpochOrder(rank=rank, **p)
    full = order.batches()
    k = data.draw(st.integers(0, len(full)))
    rest = order.batches(start=k)
    assert len(rest) == len(full) - k
    for a, b in zip(rest, full[k:], strict=True):
        assert np.array_equal(a, b)


@given(st.integers(1, 200), st.integers(0, 100))
@settings(max_examples=50, deadline=None)
def test_order_depends_on_seed_and_epoch_only(num_samples, seed):
    a = EpochOrder(num_samples, 7, seed=seed, epoch=3).indices()
    b = EpochOrder(num_samples, 7, seed=seed, epoch=3).indices()
    assert np.array_equal(a, b)
    if num_samples > 5:
        assert not np.array_equal(a, EpochOrder(num_samples, 7, seed=seed, epoch=4).indices())


def indices_of(loader, limit=None):
    out = []
    for batch in loader.host_batches():
        out.append(batch.indices.tolist())
        if limit is not None and len(out) == limit:
            break
    return out


@given(st.integers(5, 120), st.integers(1, 4), st.data())
@settings(max_examples=40, deadline=None)
def test_loader_resume_mid_epoch_via_state_dict(num_samples, world_size, data):
    rank = data.draw(st.integers(0, world_size - 1))
    def make():
        return delay_loader(num_samples, batch_size=4, rank=rank, world_size=world_size, delay_s=0.0,
                            background=False)

    reference = make()
    reference.set_epoch(2)
    full = indices_of(reference)
    k = data.draw(st.integers(0, len(full)))
    first = make()
    first.set_epoch(2)
    head = indices_of(first, limit=k) if k else []
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    tail = indices_of(resumed) if k < len(full) else []
    assert head + tail == full


def test_epoch_advances_after_a_full_pass_and_set_epoch_restarts():
    loader = delay_loader(40, batch_size=8, delay_s=0.0, background=False)
    first = indices_of(loader)
    assert loader.epoch == 1 and loader.state_dict()["batches_done"] == 0
    loader.set_epoch(0)
    assert indices_of(loader) == first
    assert indices_of(loader) != first  # epoch 1 has its own order


def test_the_epoch_order_is_numpy_s_permutation_of_the_seed():
    import numpy as np

    from loadopt.loaders.sampler import epoch_permutation

    for n in (1, 7, 100_003):
        expected = np.random.Generator(np.random.PCG64([3, 2])).permutation(n)
        got = epoch_permutation(n, 3, 2)
        assert got.dtype == np.int64 and np.array_equal(got, expected)
