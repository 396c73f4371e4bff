"""The one native piece: crops of stored images with streaming stores (loadopt/loaders/_crops.c).

Optional: where it cannot be compiled (no C compiler), loadopt uses its NumPy/OpenCV crops instead.
"""

import platform
import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3"]
if platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32":
    flags.append("-mssse3")  # the 16-pixel mirror; every x86-64 CPU since 2006 has it

setup(ext_modules=[Extension("loadopt.loaders._crops", ["loadopt/loaders/_crops.c"], extra_compile_args=flags,
                             optional=True)])
