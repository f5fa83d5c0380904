"""Prefix retention: cached prefix states kept below the GPU (host memory, disk, a shared pool).

The core side (`tiers.PrefixTiers`, with `host_index.HostIndex` and `disk_index.DiskIndex`) decides what
moves where and when, and says so in each plan's `flare.engine.step.PageTransfers`; the runner side
(`page_store.RetainedPages`: `host_pages`, `disk_store`, `pool_client`) owns the bytes and does it. No page
content crosses the step contract, only the orders and the news of their completion.
"""
