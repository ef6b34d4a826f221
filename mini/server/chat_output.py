"""One chat choice's output as OpenAI shapes it: reasoning, content and tool calls, as a final message or as
stream deltas. Both come from the same state machine, so a stream always adds up to the full response.

Thinking mode: the text up to `</think>` is `reasoning_content` (a tail that could begin the marker is held
back while the text grows). With tools offered (tool_choice auto, required or named), a grammar makes any calls
block the model starts well-formed (mini.server.grammars), so the calls are streamed as they are decoded, OpenAI
style: per call a first delta with its index, id and name, then its arguments text in pieces
(mini.server.tool_calls.parse_partial_block); content is held back only from a possible block start; the final
message reads the same calls.
"""
from __future__ import annotations

from mini.engine import RequestOutput
from mini.server.tool_calls import ToolCall, held_back, parse_partial_block
from mini.chat_format import END_THINK, TOOL_CALLS_START


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
        """`tool_names`: the offered tools whose calls are read (None: the output is not read for calls); a
        grammar makes their block well-formed, so calls are shown as they are decoded, and a block cut short
        (max_tokens, a stop string) keeps its calls as far as they got."""
        self.index, self.thinking, self.tool_names = index, thinking, tool_names
        self.sent_reasoning = self.sent_content = 0
        self.calls: list[ToolCall] = []
        self.sent_args: list[int] = []  # per call streamed so far: the length of its arguments text sent
        self.block_closed = False  # the calls block is complete and well-formed (finish_reason "tool_calls")

    def _parts(self, out: RequestOutput) -> tuple[str, str]:
        """(reasoning, content) that can be shown now; updates the calls as they grow."""
        reasoning, content = split_reasoning(out.text, out.finished) if self.thinking else ("", out.text)
        if self.tool_names is None:
            return reasoning, content
        i = content.find(TOOL_CALLS_START)
        if i >= 0:
            partial, state = parse_partial_block(content[i + len(TOOL_CALLS_START):], self.tool_names, out.finished)
            if partial or not out.finished:  # else (nothing to call, and the end): the text is content
                self._grow(partial)
                self.block_closed = state == "closed"
                return reasoning, content[:i]
        return reasoning, content if out.finished else content[:held_back(content)]

    def _grow(self, partial) -> None:
        """Take the calls as parsed so far (each one's arguments extend what was shown)."""
        for k, p in enumerate(partial):
            if k == len(self.calls):
                self.calls.append(ToolCall(p.name, ""))
            self.calls[k].arguments = p.arguments

    def finish_reason(self, out: RequestOutput) -> str | None:
        return "tool_calls" if self.calls and self.block_closed else out.finish_reason

    def message(self, out: RequestOutput) -> dict:
        reasoning, content = self._parts(out)
        msg = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.thinking:
            msg["reasoning_content"] = reasoning
        if self.calls:
            msg["tool_calls"] = [c.openai() for c in self.calls]
        return msg

    def deltas(self, out: RequestOutput) -> list[dict]:
        """The deltas this output adds (possibly empty ones: a token whose text is held back). Calls: a first
        delta with the call's index, id and name, then its arguments text in pieces as it grows."""
        reasoning, content = self._parts(out)
        delta = {"content": content[self.sent_content:]}
        if self.thinking:
            delta = {"reasoning_content": reasoning[self.sent_reasoning:], **delta}
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        deltas = [delta]
        for k, c in enumerate(self.calls):
            if k == len(self.sent_args):
                deltas.append({"tool_calls": [{"index": k, "id": c.id, "type": "function",
                                               "function": {"name": c.name, "arguments": ""}}]})
                self.sent_args.append(0)
            if len(c.arguments) > self.sent_args[k]:
                piece = c.arguments[self.sent_args[k]:]
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
                self.sent_args[k] = len(c.arguments)
        return deltas
