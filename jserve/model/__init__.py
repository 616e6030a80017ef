"""The model: a Flax NNX Llama-family decoder and its attention backends."""

from jserve.model.dense_attention import DenseAttention, dense_attention, init_cache
from jserve.model.llama import LlamaModel, param_names, param_shapes

__all__ = ["DenseAttention", "LlamaModel", "dense_attention", "init_cache", "param_names",
           "param_shapes"]
