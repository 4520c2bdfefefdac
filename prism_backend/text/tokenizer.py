"""A checkpoint's tokenizer and chat template, without torch.

The tokenizer step runs in its own Triton stub; loading the tokenizer through transformers'
AutoTokenizer would import torch there (transformers 5 imports it wherever it is installed), about
300 MiB per stub for nothing. A checkpoint with a `tokenizer.json` and a chat template is read
with what AutoTokenizer itself uses underneath: the `tokenizers` library for the ids and
transformers' own jinja renderer (`render_jinja_template`, a torch-free module) for the template,
with the special tokens transformers passes it. tests/test_prompt.py checks the ids and the text
against AutoTokenizer's. A checkpoint without them (a sentencepiece-only tokenizer, a template
stored elsewhere) goes through AutoTokenizer, torch and all.
"""
from __future__ import annotations

import json
from pathlib import Path

# The files of a checkpoint that decide how a prompt is rendered and tokenized (this module's and
# AutoTokenizer's: fast, BPE and sentencepiece tokenizers): the calibration, which tokenizes its
# prompts, depends on them (engine/calibration.py's cache key)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
# what transformers' tokenizers pass to a chat template (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTokenizer:
    """What the prompt builder needs of a tokenizer: the chat template, ids, added tokens."""

    def __init__(self, encode, encode_many, render, added_tokens: list[str], source: str):
        self._encode, self._encode_many, self._render = encode, encode_many, render
        self.added_tokens = added_tokens  # special tokens as text: safe cut points in a prompt
        self.source = source  # "tokenizers" (torch-free) or "transformers" (AutoTokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no BOS/EOS added (the template writes its own)."""
        return self._encode(text)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text, in one call: the `tokenizers` library encodes them in parallel
        (a request's prompts: about half the time of one after another on 2 cores)."""
        return self._encode_many(texts)

    def render(self, messages: list[dict]) -> str:
        """The chat as the template writes it, ending with the assistant turn's opening."""
        return self._render(messages)


def load_tokenizer(model_dir: Path) -> ChatTokenizer:
    model_dir = Path(model_dir)
    template = _chat_template(model_dir)
    if template is None or not (model_dir / "tokenizer.json").exists():
        return _transformers_tokenizer(model_dir)
    from tokenizers import Tokenizer
    from transformers.utils.chat_template_utils import render_jinja_template

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = _special_tokens(model_dir)

    def render(messages):
        rendered, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=True, **special)
        return rendered[0]

    added = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content]
    return ChatTokenizer(lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                         lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)],
                         render, added, "tokenizers")


def _chat_template(model_dir: Path) -> str | None:
    """The checkpoint's one chat template (chat_template.jinja, or tokenizer_config.json's), or None
    when it has none or several (AutoTokenizer's rules then apply)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    config = _tokenizer_config(model_dir)
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _special_tokens(model_dir: Path) -> dict[str, str]:
    """{"bos_token": "<|im_start|>", ...}: tokenizer_config.json's named special tokens as text
    (an entry may be a string or an AddedToken record with "content")."""
    config = _tokenizer_config(model_dir)
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None:
            out[name] = str(value)
    return out


def _transformers_tokenizer(model_dir: Path) -> ChatTokenizer:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.content]
    return ChatTokenizer(
        lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
        lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"],
        lambda messages: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        added,
        "transformers",
    )
