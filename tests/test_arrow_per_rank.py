"""The Arrow form's index per rank: a rank locating its share of an epoch under the window shuffle reads the
offsets of its own record batches (views of the mapped shards, nothing concatenated over the dataset), and the
bytes it locates are its samples'."""

import numpy as np

from loadopt.config import config_from_dict
from loadopt.loaders.arrow_column import ArrowColumn
from loadopt.loaders.sampler import EpochOrder, ShardWindows
from loadopt.storage import arrow_convert, arrow_format
from loadopt.storage.imagefolder import open_dataset
from loadopt.storage.shards import shard_table

from .test_records import records_config

WORLD = 4


def test_a_rank_reads_its_share_of_the_arrow_index_and_locates_its_own_bytes(tmp_path):
    spec = records_config(tmp_path, "raw", record_bytes=64, record_bytes_stdev=0, delivered_bytes=64,
                          samples_per_file=2000, num_files=16)
    spec["pipeline"].update(shuffle="window", window_shards=2, batch_size=64)
    config = config_from_dict(spec, "rec.yaml")
    dataset = open_dataset(config)
    arrow_convert.convert(dataset, "records", None, shard_mib=0.5)
    conversion = arrow_format.open_arrow(arrow_format.arrow_path(dataset, "records", None, 0.5), dataset, "records",
                                         None, 0.5)
    assert len(conversion.files) > 2
    windows = ShardWindows(shard_table(dataset, config.pipeline.shard_samples), config.pipeline.window_shards)
    needed = []
    for rank in range(WORLD):
        column = ArrowColumn(list(conversion), conversion.batch_file.copy())
        order = EpochOrder(len(dataset), config.pipeline.batch_size, config.seed, 0, rank, WORLD, "window",
                           windows=windows)
        for batch in order.batches():
            located = column.locate(batch)
            for k in range(0, len(batch), 7):
                assert bytes(located.bytes_of(k)) == dataset.read(int(batch[k]))
        needed.append(column.index_bytes_read())
    whole = column.index_bytes()
    assert whole >= len(dataset) * 8  # an int64 offset a sample
    # each rank's pages of offsets: its 4 files' and the page at each end, far under the whole index
    assert max(needed) < 0.5 * whole, (needed, whole)
    assert sum(needed) >= whole  # together the ranks read every sample's offsets
    assert np.all(np.array(needed) > 0)
