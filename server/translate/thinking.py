"""Reasoning across dialects: chat's `reasoning_effort` and Anthropic's `thinking` budget, one table read both ways
(docs/api.md, Request bodies), and what Anthropic's API refuses while thinking is on, for both dialects' callers.

An upstream of the caller's dialect receives the caller's field whole; the embedded model has no reasoning and
ignores both. These rules are for an upstream of the other dialect.
"""

from __future__ import annotations

from collections.abc import Mapping

from server.domain import Json, Reasoning, SamplingParams, Thought, ToolChoice, ToolChoiceMode, Unread
from server.translate.values import is_integer, opt_array, opt_string, shown, wrong_type

LEAST_THINKING_BUDGET = 1024  # Anthropic's API refuses an `enabled` thinking's budget_tokens below this
NO_REASONING = "none"  # chat's effort that asks for no reasoning: no thinking
# chat's `reasoning_effort` (every value of the openai SDK's ReasoningEffort but "none") -> Anthropic's budget_tokens.
# The least is Anthropic's least; each step doubles, as LiteLLM's low/medium/high do.
EFFORT_BUDGETS = {"minimal": 1024, "low": 1024, "medium": 2048, "high": 4096, "xhigh": 8192, "max": 16384}
# The inverse, for an OpenAI-compatible upstream: a budget from the least of a row up is that effort. Only the three
# efforts every reasoning server takes (vLLM's and llama.cpp's refuse `minimal`, `xhigh` and `max`).
_EFFORTS = ((EFFORT_BUDGETS["high"], "high"), (EFFORT_BUDGETS["medium"], "medium"), (0, "low"))
_THINKING_TOP_P = 0.95  # the least top_p Anthropic's API takes while thinking is on
_FORCED = (ToolChoiceMode.REQUIRED, ToolChoiceMode.TOOL)
THINKING_BLOCK_TYPES = ("thinking", "redacted_thinking")  # Anthropic's content blocks of a model's reasoning
THINKING_ON = ("enabled", "adaptive")  # Messages' `thinking` types that have the model think


def thinking_block(thought: Thought) -> dict:
    """A Thought as Anthropic's API sends its block and takes it back (also LiteLLM's `thinking_blocks` item)."""
    if thought.redacted:
        return {"type": "redacted_thinking", "data": thought.redacted}
    return {"type": "thinking", "thinking": thought.text, "signature": thought.signature}


def effort_of(budget: int) -> str:
    """The `reasoning_effort` a thinking budget is: 1024–2047 tokens `low`, 2048–4095 `medium`, 4096 and up
    `high`."""
    return next(effort for least, effort in _EFFORTS if budget >= least)


def beside_thinking(params: SamplingParams, choice: ToolChoice | None, *, top_k: bool,
                    embedded: bool = True) -> list[Unread]:
    """While thinking is on, Anthropic's API refuses a temperature other than 1, any top_k (`top_k`: the caller sent
    one that would be sent), a top_p under 0.95 and a tool_choice that forces a call: refused by name here, rather
    than by the upstream about a body the caller never saw, or answered here and refused once the model is served by
    Anthropic. `embedded`: whether the embedded model refuses them too. The first one is named."""
    if params.temperature is not None and params.temperature != 1:
        return [Unread("temperature", "`temperature` may only be set to 1 when thinking is enabled.", embedded)]
    if top_k:
        return [Unread("top_k", "`top_k` may not be set when thinking is enabled.", embedded)]
    if params.top_p is not None and params.top_p < _THINKING_TOP_P:
        return [Unread("top_p", f"`top_p` must be greater than or equal to {_THINKING_TOP_P} or unset when thinking "
                                "is enabled.", embedded)]
    if choice is not None and choice.mode in _FORCED:
        return [Unread("tool_choice", "Thinking may not be enabled when tool_choice forces tool use.", embedded)]
    return []


def chat_reasoning(body: Mapping[str, Json], params: SamplingParams, choice: ToolChoice | None,
                   limit_field: str | None) -> tuple[Reasoning | None, list[Unread]]:
    """A chat request's `reasoning_effort` (type-checked already) as the thinking an Anthropic upstream is asked for,
    and what that upstream would refuse beside it (the embedded model ignores the effort, so refuses none of it).
    `limit_field`: the caller's token-limit field, None when it sent none: then the limit sent has the budget on top
    of the default, since Anthropic refuses a budget not under max_tokens."""
    effort = body.get("reasoning_effort")
    if effort is None or effort == NO_REASONING:
        return None, []
    budget = EFFORT_BUDGETS.get(effort)
    if budget is None:
        return None, [Unread("reasoning_effort", f"`reasoning_effort` {shown(effort)} is not supported by this model; "
                             f"supported: {NO_REASONING}, {', '.join(EFFORT_BUDGETS)}.", embedded=False)]
    unread = []
    if limit_field is not None and params.max_tokens <= budget:
        unread.append(Unread(limit_field, f"`{limit_field}` must be greater than the thinking budget of "
                             f"`reasoning_effort` {shown(effort)} on this model ({budget} tokens), got "
                             f"{params.max_tokens}.", embedded=False))
    unread += beside_thinking(params, choice, top_k=params.top_k is not None, embedded=False)
    return Reasoning(effort=effort, budget_tokens=budget, room=0 if limit_field else budget), unread


def messages_reasoning(body: Mapping[str, Json], effort: str | None = None) -> Reasoning | None:
    """A Messages request's `thinking` (checked already) and `effort` (its `output_config.effort` as a
    `reasoning_effort`, None: not given) as the reasoning an OpenAI-compatible upstream is asked for. One rule: the
    effort, when given, is the one sent, whatever `thinking` says; without it, `enabled` with a budget is that budget's
    effort, and `adaptive` (the depth left to the model) and `disabled` are none (the server's own default), as is
    `between_tools` (thinking off: such a server writes no notes between calls). `enabled` and `adaptive` also show
    the caller the thinking, unless its `display` is `omitted` (Anthropic then sends the blocks without their text,
    which only a signature carries); the others or no thinking do not."""
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    shown = kind in THINKING_ON and thinking.get("display") != "omitted"
    if kind == "adaptive":
        return Reasoning(effort=effort, shown=shown)
    budget = thinking.get("budget_tokens") if kind == "enabled" else None
    if not is_integer(budget):  # refused beside it (_check_thinking), or no thinking
        return Reasoning(effort=effort, shown=False) if effort is not None else None
    budget = int(budget)  # a whole float (2048.0) is that budget, as it was checked (and as Anthropic reads it)
    return Reasoning(effort=effort or effort_of(budget), budget_tokens=budget, shown=shown)


def chat_thoughts(message: Mapping[str, Json], where: str, unread: list[Unread]) -> tuple[Thought, ...]:
    """A chat assistant message's `thinking_blocks` (LiteLLM's member: the blocks of an Anthropic model's answer, given
    back), each as Anthropic takes it back: a `thinking` block with its text and its signature, or a
    `redacted_thinking` block with its data. Type-checked for every model; a block Anthropic would refuse (another
    type, no signature) is refused, naming it, by an Anthropic upstream only: an OpenAI-compatible one gets the body
    as it came (LiteLLM's blocks of other providers may be unsigned), and the embedded model ignores them."""
    thoughts = []
    for i, block in enumerate(opt_array(message, "thinking_blocks", where) or ()):
        at = f"{where}.thinking_blocks[{i}]"
        if not isinstance(block, dict):
            raise wrong_type(at, "an object", block)
        kind, text = opt_string(block, "type", at), opt_string(block, "thinking", at)
        signature, data = opt_string(block, "signature", at), opt_string(block, "data", at)
        if kind == "thinking" and text is not None and signature:
            thoughts.append(Thought(text, signature))
        elif kind == "redacted_thinking" and data:
            thoughts.append(Thought(redacted=data))
        else:
            unread.append(_unsigned(at, kind, text))
    return tuple(thoughts)


def _unsigned(at: str, kind: str | None, text: str | None) -> Unread:
    """The refusal of a block Anthropic cannot take back, naming what it lacks."""
    if kind not in THINKING_BLOCK_TYPES:
        return Unread(f"{at}.type", f"`{at}.type` must be 'thinking' or 'redacted_thinking'; got {shown(kind)}.",
                      embedded=False)
    name = "data" if kind == "redacted_thinking" else "thinking" if text is None else "signature"
    return Unread(f"{at}.{name}", f"`{at}.{name}` is required: Anthropic takes thinking back only as it sent it.",
                  embedded=False)
