"""Loaded at start-up only by ztunnels that ``bench_hbone.py --variant`` starts with this directory
on PYTHONPATH: applies the experiment patches named in ``ZT_BENCH_PATCH`` (see hbone_patches)."""

import os

if os.environ.get("ZT_BENCH_PATCH") or os.environ.get("ZT_BENCH_TUNE"):
    import hbone_patches

    hbone_patches.apply_from_env()
