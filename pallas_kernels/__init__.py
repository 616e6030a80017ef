"""Pallas kernels for jserve: one folder per kernel, each with its pure-jnp reference beside it."""
