"""The one native module: crops with streaming stores, reads into crops, and normalisation (loadopt/_native.c).

Optional: where it cannot be compiled (no C compiler), loadopt uses its NumPy/OpenCV crops instead.
"""

import platform
import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3"]
if platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32":
    flags.append("-mssse3")  # the 16-pixel mirror; every x86-64 CPU since 2006 has it

setup(ext_modules=[Extension("loadopt._native", ["loadopt/_native.c"], extra_compile_args=flags,
                             optional=True)])
