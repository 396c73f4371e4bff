# Types of loadopt/_native.c (a C extension: mypy cannot read its signatures from the built module).
from typing import Any

SIMD: int

def crop_batch(out: Any, sources: Any, which: Any, offsets: Any, flips: Any, stride: int, size: int, first: int,
               last: int, threads: int = 1, /) -> None: ...
def read_crops(out: Any, maps: Any, fds: Any, which: Any, offsets: Any, flips: Any, stride: int, size: int,
               first: int, last: int, threads: int, /) -> tuple[int, int, int]: ...
def normalise(out: Any, inputs: Any, scale: Any, shift: Any, /) -> bool: ...
