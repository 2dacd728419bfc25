"""Fakes for the agent tests: a character-level tokenizer with the Qwen tool template of
``tiny-qwen3`` (re-tokenising text is exact, so merges depend on the template alone), and a
FakeEngine responder that writes scripted text."""

from __future__ import annotations

import string
from typing import Callable, Optional, Sequence

from asyncrl.engine.fake import FakeEngine
from asyncrl.engine.protocol import GenerationRequest
from asyncrl.model.tiny_qwen3 import CHATML_TEMPLATE

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 2


def qwen_char_tokenizer():
    """Character-level PreTrainedTokenizerFast over printable ASCII: <|endoftext|>=0 (pad),
    <|im_start|>=1, <|im_end|>=2 (EOS), with tiny-qwen3's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    hf.chat_template = CHATML_TEMPLATE
    return hf


def text_engine(tokenizer, script: Callable[[GenerationRequest, int], str], **kwargs) -> FakeEngine:
    """A FakeEngine whose sample ``i`` of ``request`` is ``script(request, i)`` encoded, then EOS."""

    def responder(request: GenerationRequest, i: int) -> Sequence[int]:
        return [*tokenizer.encode(script(request, i), add_special_tokens=False), EOS_ID]

    return FakeEngine(vocab_size=len(tokenizer), eos_token_id=EOS_ID, responder=responder, **kwargs)


def prompt_text(tokenizer, request: GenerationRequest, last: Optional[int] = None) -> str:
    return tokenizer.decode(list(request.prompt_ids)[-last if last else 0:], skip_special_tokens=False)
