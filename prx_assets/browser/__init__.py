"""The curation browser: search, filter and audit the Lance lab from a local web page.

Start it with ``python -m prx_assets.browser --data-root data --port 8765``.
"""
