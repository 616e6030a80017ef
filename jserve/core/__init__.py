"""Pure bookkeeping, the bottom layer: requests and sampling settings, the stop policy, the page
pool and page table, the scheduler (single and data-parallel) and the step-shape buckets.

Pure Python (no JAX, no numpy; tests/test_layers.py checks): everything here runs and is tested
without a device, and nothing here imports from the layers above.
"""
