"""What the router knows about a prompt without running the model.

`estimate_tokens` is a cheap guess (no tokenizer) for selective disaggregation and, without a
tokenizer, for the arrival counter (`count_prompt_tokens`): lengths only, never a walk over a
prompt's elements (bodies are validated first, so a prompt list holds one form). `PromptTokenizer`
gives exact token ids, only for prefix-aware routing; it must tokenize as the worker does
(vLLM's convention: completions add special tokens; chat renders the template with the worker's
renderer and adds nothing more).
"""

from __future__ import annotations

from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest, GenerationRequest

# English BPE averages about four characters per token; good enough for a length threshold.
CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4  # role markers and separators of a chat template
# A chat render's bounds (protocol/chat_render.py): the router knows no worker's --max-model-len,
# so the most characters a render may build are those of a long context's prompt; the time is a
# worker's default --chat-template-timeout.
RENDER_MAX_TOKENS = 1 << 20
RENDER_MAX_CHARS = 16 * RENDER_MAX_TOKENS
RENDER_TIMEOUT_S = 10.0


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
    """A request's prompt token ids as the worker computes them: a chat rendered by the worker's
    own renderer (protocol/chat_render.py: tools, chat_template_kwargs and the generation-prompt
    fields included), so the router's prefix hashes are the worker's."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer  # only prefix-aware routers pay for this import

        from pdserve.protocol.chat_render import ChatTemplates

        self._tok = AutoTokenizer.from_pretrained(path)
        # The router runs no client template (the worker decides whether to trust one) and
        # bounds a render as a worker does by default; a render past its bounds is the worker's
        # to refuse, and the request is routed without token ids.
        self._templates = ChatTemplates(self._tok, RENDER_MAX_TOKENS, RENDER_MAX_CHARS, RENDER_TIMEOUT_S,
                                        trust_requests=False)

    def __call__(self, request: GenerationRequest) -> list[int] | None:
        from pdserve.protocol.chat_render import offered_tools, render_chat

        try:
            if isinstance(request, ChatCompletionRequest):
                text = render_chat(self._templates, request, offered_tools(request))
                # The template writes the special tokens itself: add none on top (as the worker).
                return self._tok(text, add_special_tokens=False)["input_ids"]
            prompt = request.prompt
            if isinstance(prompt, str):
                return self._tok(prompt)["input_ids"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return prompt
        except Exception:  # a prompt the template rejects is the worker's to report, not ours
            return None
        return None
