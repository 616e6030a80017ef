"""A tiny tokenizer for reasoning tests: byte-level BPE (256 byte tokens, no merges) with
`<think>` (256) and `</think>` (257) as added tokens, as Qwen3's and DeepSeek-R1's are, and
`<|im_end|>` (258) as end of sequence; its chat template is a cut-down Qwen3 one (ChatML,
`enable_thinking`, an assistant turn's `reasoning_content` written back in a think block)."""

from __future__ import annotations

import json
from pathlib import Path

THINK, END_THINK, IM_END = 256, 257, 258
VOCAB = 259

TEMPLATE = (
    "{%- for m in messages -%}"
    "<|im_start|>{{ m['role'] }}\n"
    "{%- if m['role'] == 'assistant' and m.get('reasoning_content') -%}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n"
    "{%- endif -%}"
    "{{ m['content'] }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false -%}<think>\n\n</think>\n\n{%- endif -%}"
    "{%- endif -%}")


def write_tokenizer(folder: Path) -> Path:
    """The tokenizer's files (tokenizer.json, tokenizer_config.json) in `folder`."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True, normalized=False)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False, "chat_template": TEMPLATE}))
    return folder


def load_tokenizer(folder: Path):
    from jserve.text.tokenizer import Tokenizer

    tok = Tokenizer.load(write_tokenizer(folder))
    a = tok.encode("a", add_special_tokens=False)
    assert tok.encode("<think>a</think>", add_special_tokens=False) == [THINK, *a, END_THINK]
    return tok
