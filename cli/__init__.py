"""kvxfer's command line: demo, plan, diff, golden, schema, run, bench.

``kvxfer.cli.__version__`` is the installed distribution's version (there is no top-level ``kvxfer``
package to hold it); ``kvxfer --version`` prints it.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvxfer")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
