"""What the router knows about a prompt without running the model.

`estimate_tokens` is a cheap guess (no tokenizer) for selective disaggregation and, without a
tokenizer, for the arrival counter (`count_prompt_tokens`): lengths only, never a walk over a
prompt's elements (bodies are validated first, so a prompt list holds one form). `PromptTokenizer`
gives exact token ids, only for prefix-aware routing; it must tokenize as the worker does
(vLLM's convention: completions add special tokens; chat applies the chat template with the
generation prompt and adds nothing more).
"""

from __future__ import annotations

from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest, GenerationRequest

# English BPE averages about four characters per token; good enough for a length threshold.
CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4  # role markers and separators of a chat template


def _text_len(content) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # OpenAI content parts
        return sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return 0


def _prompt_tokens(prompt) -> int:
    """A completions prompt's estimate; of a batch, its first prompt stands for the rest."""
    if isinstance(prompt, str):
        return len(prompt) // CHARS_PER_TOKEN
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):  # token ids (validated: a list holds one form)
            return len(prompt)
        first = prompt[0]
        return len(first) if isinstance(first, list) else _text_len(first) // CHARS_PER_TOKEN
    return 0


def estimate_tokens(request: GenerationRequest) -> int:
    if isinstance(request, ChatCompletionRequest):
        chars = sum(_text_len(m.content) for m in request.messages)
        return chars // CHARS_PER_TOKEN + TOKENS_PER_MESSAGE * len(request.messages)
    return _prompt_tokens(request.prompt)


def count_prompt_tokens(request: GenerationRequest, token_ids: list[int] | None) -> int:
    """Prompt tokens of a request, for the arrival counter: exact from the router's token ids
    when it has them, else the estimate (summed over a batch of prompts)."""
    if token_ids is not None:
        return len(token_ids)
    if isinstance(request, CompletionRequest):
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            return sum(_prompt_tokens(p) for p in prompt)
    return estimate_tokens(request)


def decodes_one_token(request: GenerationRequest) -> bool:
    """The client's budget is one token: the prefill's first token is the whole answer."""
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens == 1:
        return True
    return request.max_tokens == 1


class PromptTokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer  # only prefix-aware routers pay for this import

        self._tok = AutoTokenizer.from_pretrained(path)

    def __call__(self, request: GenerationRequest) -> list[int] | None:
        try:
            if isinstance(request, ChatCompletionRequest):
                messages = [m.model_dump(exclude_unset=True) for m in request.messages]
                out = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
            prompt = request.prompt
            if isinstance(prompt, str):
                return self._tok(prompt)["input_ids"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return prompt
        except Exception:  # a prompt the template rejects is the worker's to report, not ours
            return None
        return None
