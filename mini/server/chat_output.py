"""One chat choice's output as OpenAI shapes it: reasoning, content and tool calls, as a final message or as
stream deltas. Both come from the same state machine, so a stream always adds up to the full response.

Thinking mode: the text up to `</think>` is `reasoning_content` (a tail that could begin the marker is held
back while the text grows). With tools offered, content is held back from a possible calls block start to the
end of the output; then the block is parsed (mini.server.tool_calls) into calls, or, if malformed, given as
content after all.
"""
from __future__ import annotations

from mini.engine import RequestOutput
from mini.server.tool_calls import ToolCall, held_back, parse_tool_calls
from mini.tokenizer import END_THINK


def split_reasoning(text: str, final: bool) -> tuple[str, str]:
    """Thinking mode: the model writes its reasoning, `</think>`, then the answer. While the text is still
    growing, a tail that could be the start of the marker is held back (it is neither part yet)."""
    i = text.find(END_THINK)
    if i >= 0:
        return text[:i], text[i + len(END_THINK):]
    if not final:
        for k in range(len(END_THINK) - 1, 0, -1):
            if text.endswith(END_THINK[:k]):
                return text[:-k], ""
    return text, ""


class ChatChoice:
    def __init__(self, index: int, thinking: bool, tool_names: set[str] | None):
        """`tool_names`: the offered tools whose calls are parsed (None: the output is not read for calls)."""
        self.index, self.thinking, self.tool_names = index, thinking, tool_names
        self.sent_reasoning = self.sent_content = 0
        self.calls: list[ToolCall] = []

    def _parts(self, out: RequestOutput) -> tuple[str, str]:
        """(reasoning, content) that can be shown now; at the end, parses the calls."""
        reasoning, content = split_reasoning(out.text, out.finished) if self.thinking else ("", out.text)
        if self.tool_names is not None:
            if out.finished:
                content, self.calls = parse_tool_calls(content, self.tool_names)
            else:
                content = content[:held_back(content)]
        return reasoning, content

    def finish_reason(self, out: RequestOutput) -> str | None:
        return "tool_calls" if self.calls else out.finish_reason

    def message(self, out: RequestOutput) -> dict:
        reasoning, content = self._parts(out)
        msg = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.thinking:
            msg["reasoning_content"] = reasoning
        if self.calls:
            msg["tool_calls"] = [c.openai() for c in self.calls]
        return msg

    def deltas(self, out: RequestOutput) -> list[dict]:
        """The deltas this output adds (possibly empty ones: a token whose text is held back); calls come at the
        end, each as a first delta with its id and name and a second with its arguments."""
        reasoning, content = self._parts(out)
        delta = {"content": content[self.sent_content:]}
        if self.thinking:
            delta = {"reasoning_content": reasoning[self.sent_reasoning:], **delta}
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        deltas = [delta]
        for k, c in enumerate(self.calls if out.finished else []):
            deltas.append({"tool_calls": [{"index": k, "id": c.id, "type": "function",
                                           "function": {"name": c.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": k, "function": {"arguments": c.arguments}}]})
        return deltas
