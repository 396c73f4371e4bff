"""The native modules (each optional: where one cannot be compiled, loadopt uses its Python paths instead).

- loadopt/_native.c: crops with streaming stores, reads into crops, normalisation (needs a C compiler);
- loadopt/storage/_preads.c: the probe's timed random reads with the GIL released (needs a C compiler);
- loadopt/_jpeg.c: JPEG region decoding (needs libjpeg-turbo's headers: `apt install libjpeg-turbo8-dev`
  or `libjpeg62-turbo-dev`; without them, JPEGs are decoded whole by simplejpeg or PIL).
"""

import platform
import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3"]
if platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32":
    flags.append("-mssse3")  # the 16-pixel mirror; every x86-64 CPU since 2006 has it

setup(ext_modules=[Extension("loadopt._native", ["loadopt/_native.c"], extra_compile_args=flags, optional=True),
                   Extension("loadopt.storage._preads", ["loadopt/storage/_preads.c"], extra_compile_args=flags,
                             optional=True),
                   Extension("loadopt._jpeg", ["loadopt/_jpeg.c"], libraries=["jpeg"],
                             extra_compile_args=[] if sys.platform == "win32" else ["-O2"], optional=True)])
