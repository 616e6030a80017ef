"""A native CPU matmul over weights packed once at load (`native.matmul_packed`): the paged
runner's layer matmuls and tied LM head on CPU, where XLA's dots are slow at a few rows."""
