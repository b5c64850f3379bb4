"""POST /tokenize and /detokenize (vLLM's utility routes; bodies in protocol/tokenize.py).

The chat form renders the prompt with chat.render_prompt, the function a chat completion uses,
so its `count` is the prompt a completion of those messages would run. Tools are rendered for
the template as `"auto"` would render them, without the flags `"auto"` needs: nothing is
generated, so no parser has to read a reply.
"""

from __future__ import annotations

from pdserve.protocol.tokenize import TokenizeChatRequest, detokenize_request, tokenize_request
from pdserve.worker.server import serving
from pdserve.worker.server.chat import render_prompt
from pdserve.worker.server.tool_parsers.plan import ToolPlan


def tokenize(state, body: dict) -> dict:
    """Bounded as a completion's prompt is: a text no tokenization could fit into
    --max-model-len is refused before it is tokenized, and a result over
    --max-request-prompt-tokens is not sent. A count over --max-model-len is still answered, as
    vLLM answers it: a client learns how much to cut."""
    req = tokenize_request(body)
    serving.resolve_model(state, req.model)
    tok = state.tokenizer
    if isinstance(req, TokenizeChatRequest):
        chat = req.as_chat()
        tools = ToolPlan(tools=[t.model_dump(exclude_none=True) for t in chat.tools]) if chat.tools else ToolPlan()
        ids = render_prompt(state.chat_templates, chat, tools, state.config.tool_call_parser)
        if req.add_special_tokens:
            ids = tok.build_inputs_with_special_tokens(ids)
        param = "messages"
    else:
        serving.check_text_length(req.prompt, state.max_prompt_chars, state.max_model_len, "prompt")
        ids = tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        param = "prompt"
    state.limits.check_prompt_tokens(len(ids), param)
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}


def detokenize(state, body: dict) -> dict:
    req = detokenize_request(body)
    serving.resolve_model(state, req.model)
    state.limits.check_prompt_tokens(len(req.tokens), "tokens")
    serving.check_token_ids(req.tokens, state.vocab_size, "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}
