"""The oracle for the Llama family: transformers' ``LlamaForCausalLM``, loading the GGUF file itself.

Transformers reads and dequantizes the file with its own code (its GGUF integration), so a mistake in
this project's loader (:mod:`shared.gguf_file`: the rotary rows, the fused projections, the tokenizer)
shows up as a difference, not as the same mistake on both sides. Greedy answers are computed one
sequence at a time with transformers' own KV cache, and are exactly ``max_new_tokens`` tokens long (end
of turn is not a stop, as in ``/v1/inference``'s contract).
"""

from __future__ import annotations

import warnings

import torch


class LlamaOracle:
    """Greedy answers of transformers' model, remembered per (prompt, max_new_tokens)."""

    def __init__(self, gguf_path) -> None:
        from transformers import AutoTokenizer, LlamaForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = LlamaForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                          torch_dtype=torch.float32).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        self._answers: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.no_grad()
    def logits(self, prompt_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([prompt_ids])).logits[0]

    @torch.no_grad()
    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._answers:
            answer, past, step = [], None, torch.tensor([prompt_ids])
            for _ in range(max_new_tokens):
                out = self.model(step, past_key_values=past, use_cache=True)
                past = out.past_key_values
                answer.append(int(out.logits[0, -1].argmax()))
                step = torch.tensor([[answer[-1]]])
            self._answers[key] = answer
        return list(self._answers[key])

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """Hugging Face's rendering of the model's chat template, ending where the answer begins."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
