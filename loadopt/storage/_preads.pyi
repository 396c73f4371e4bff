# Types of loadopt/storage/_preads.c (a C extension: mypy cannot read its signatures from the built module).
from typing import Any

def timed_reads(fds: Any, offsets: Any, lengths: Any, buffer: Any, latencies: Any, end_ns: int,
                align: bool, /) -> tuple[int, int, int, int]: ...
