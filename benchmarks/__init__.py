"""jserve's benchmarks by subject (kernels, step, engine, serving), each run from the repository root
as `python -m benchmarks.<subject>.<name> --help`; what they share is in benchmarks.harness."""
