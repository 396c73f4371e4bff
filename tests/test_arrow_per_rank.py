"""The Arrow form's index per rank: a rank locating its share of an epoch under the window shuffle reads the
offsets of its own runs (a source shard's rows within a record batch: from the shard file with pread, or copied
from the file's image), nothing concatenated over the dataset, so it holds its share of the index and the
tables; the bytes it locates are its samples'; `forget` lets go of them."""

import numpy as np

from loadopt.config import config_from_dict
from loadopt.loaders.arrow.column import ArrowColumn
from loadopt.loaders.sampler import EpochOrder, ShardWindows
from loadopt.storage.forms import arrow_convert, arrow_format
from loadopt.storage.open import open_dataset
from loadopt.storage.sources.shards import shard_table

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
    runs = shard_table(dataset, config.pipeline.shard_samples).bounds
    assert (conversion.offsets_at >= 0).all()  # each batch's offsets found in its mapped file
    needed = []
    for rank in range(WORLD):
        # rank 0 copies its offsets from the batches' own buffers (a file's image), the others pread them
        files = (conversion.files, conversion.offsets_at) if rank else (None, None)
        column = ArrowColumn(list(conversion), conversion.batch_file.copy(), runs, *files)
        order = EpochOrder(len(dataset), config.pipeline.batch_size, config.seed, 0, rank, WORLD, "window",
                           windows=windows)
        for batch in order.batches():
            located = column.locate(batch)
            for k in range(0, len(batch), 7):
                assert bytes(located.bytes_of(k)) == dataset.read(int(batch[k]))
        needed.append(column.index_bytes_read())
    whole = column.index_bytes()
    assert whole >= len(dataset) * 8  # an int64 offset a sample
    # each rank holds its 4 files' offsets (runs straddle record batches of 1,024: one more offset a piece)
    tables = column.first_rows.nbytes + column.piece_first.nbytes
    assert max(needed) <= 1.05 * whole / WORLD + tables, (needed, whole)
    assert sum(needed) - WORLD * tables >= len(dataset) * 8  # together the ranks read every sample's offsets
    assert np.all(np.array(needed) > tables)
    column.forget()
    assert column.index_bytes_read() == tables
