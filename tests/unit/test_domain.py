"""Domain values: the one token estimate every rough count uses."""

from __future__ import annotations

from server.domain import (
    GenerationRequest, Role, SamplingParams, Thought, ToolCall, ToolSpec, Turn, estimate_tokens,
)


def test_estimate_is_characters_over_four_rounded_up():
    assert [estimate_tokens(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_prompt_estimate_counts_everything_the_model_reads():
    """Thinking given back in a tool loop included: Anthropic reads and bills it as input."""
    turns = (Turn(Role.USER, "x" * 10), Turn(Role.ASSISTANT, tool_calls=(ToolCall("c1", "f", "{}"),),
                                             thoughts=(Thought("y" * 40, "sig"),)))
    tools = (ToolSpec("f", "d", {}),)
    request = GenerationRequest(turns=turns, params=SamplingParams(max_tokens=1), tools=tools)
    assert request.estimated_prompt_tokens() == estimate_tokens(10 + 40 + 1 + 2 + 1 + 1 + len("{}"))


def test_unsigned_thinking_counts_only_in_the_current_tool_loop():
    """An OpenAI-compatible server's reasoning (unsigned) is sent back only after the caller's last own words; signed
    thinking is Anthropic's, read wherever it is."""
    earlier = Turn(Role.ASSISTANT, "a", thoughts=(Thought("y" * 40), Thought("z" * 80, "sig")))
    looped = Turn(Role.ASSISTANT, tool_calls=(ToolCall("c1", "f", "{}"),), thoughts=(Thought("w" * 400),))
    turns = (Turn(Role.USER, "x"), earlier, Turn(Role.USER, "q"), looped)
    request = GenerationRequest(turns=turns, params=SamplingParams(max_tokens=1))
    assert request.estimated_prompt_tokens() == estimate_tokens(1 + 1 + 80 + 1 + 400 + 1 + 2)
