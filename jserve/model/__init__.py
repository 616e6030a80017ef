"""The model: a Flax NNX Llama-family decoder and its contiguous-cache attention."""

from jserve.model.dense_attention import DenseAttention, dense_attention, init_cache
from jserve.model.llama import (
                                LAYOUTS,
                                LlamaModel,
                                ModelOps,
                                XlaOps,
                                model_graphdef,
                                model_params,
                                param_shapes,
                                params_layout,
)

__all__ = ["DenseAttention", "LAYOUTS", "LlamaModel", "ModelOps", "XlaOps", "dense_attention", "init_cache",
           "model_graphdef", "model_params", "param_shapes", "params_layout"]
