"""The model: a Flax NNX Llama-family decoder and its attention backends."""

from jserve.model.dense_attention import DenseAttention, dense_attention, init_cache
from jserve.model.llama import LlamaModel, model_graphdef, model_params, param_shapes

__all__ = ["DenseAttention", "LlamaModel", "dense_attention", "init_cache", "model_graphdef",
           "model_params", "param_shapes"]
