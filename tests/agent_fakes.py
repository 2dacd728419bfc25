"""Fakes for the agent tests: a character-level tokenizer with the Qwen tool template of
``tiny-qwen3`` (re-tokenising text is exact, so merges depend on the template alone), and a
FakeEngine responder that writes scripted text."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from asyncrl.engine.fake import FakeEngine
from asyncrl.engine.protocol import GenerationRequest

EOS_ID = 2


def qwen_char_tokenizer():
    """tiny-qwen3's ChatML character tokenizer (<|endoftext|>=0 pad, <|im_start|>=1, <|im_end|>=2
    EOS) with <|im_start|> also listed as an additional special token."""
    from asyncrl.model.tiny_qwen3 import chatml_char_tokenizer

    hf = chatml_char_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    return hf


def text_engine(tokenizer, script: Callable[[GenerationRequest, int], str], **kwargs) -> FakeEngine:
    """A FakeEngine whose sample ``i`` of ``request`` is ``script(request, i)`` encoded, then EOS."""

    def responder(request: GenerationRequest, i: int) -> Sequence[int]:
        return [*tokenizer.encode(script(request, i), add_special_tokens=False), EOS_ID]

    return FakeEngine(vocab_size=len(tokenizer), eos_token_id=EOS_ID, responder=responder, **kwargs)


def prompt_text(tokenizer, request: GenerationRequest, last: Optional[int] = None) -> str:
    return tokenizer.decode(list(request.prompt_ids)[-last if last else 0:], skip_special_tokens=False)
