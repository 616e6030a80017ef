"""Text, beside the bookkeeping at the bottom: tokenizers (HF tokenizer.json, sentencepiece, those
embedded in GGUF files), chat templates and incremental detokenization. No JAX."""
