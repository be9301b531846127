"""Maintainers' scripts: run as `python tools/NAME.py`; tests import them as `tools.NAME`."""
