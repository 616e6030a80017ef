"""Matmuls XLA:CPU runs slowly: `native.matmul_nt`, `x @ w.T` for a few rows of x (the LM head)."""
