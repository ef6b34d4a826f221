"""One chat choice's output as a sequence of blocks (reasoning, text, tool call), for the APIs that shape output
that way: the Responses API (output items) and Anthropic's Messages (content blocks).

Both read the same ChatChoice (mini.server.chat_output) as chat completions do, so reasoning, content and calls
are split, held back and parsed once; here its deltas become block events: a block opens, grows, closes. Only one
block is open at a time, in the order the model writes them. A whole (non-streamed) output is the same deltas
read at once, so a stream always adds up to the final blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BlockKind = Literal["reasoning", "text", "call"]


@dataclass
class Block:
    kind: BlockKind
    index: int  # position among the choice's blocks
    text: str = ""  # reasoning, text, or a call's arguments (JSON text)
    name: str = ""  # call: the tool's name
    call_id: str = ""  # call: its id (ToolCall.id)


@dataclass(frozen=True)
class BlockEvent:
    what: Literal["open", "delta", "close"]
    block: Block
    delta: str = ""


class BlockStream:
    """ChatChoice deltas in, block events out (`feed`, then `close` at the end)."""

    def __init__(self):
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self._calls: dict[int, Block] = {}  # tool_calls delta index -> its block

    def feed(self, deltas: list[dict]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._grow("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._grow("text", delta["content"])
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if "id" in call:  # a new call: its id and name come first
                    events += self._switch(Block("call", len(self.blocks), name=fn.get("name", ""),
                                                 call_id=call["id"]))
                    self._calls[call["index"]] = self.open
                if fn.get("arguments"):
                    block = self._calls[call["index"]]
                    block.text += fn["arguments"]
                    events.append(BlockEvent("delta", block, fn["arguments"]))
        return events

    def close(self) -> list[BlockEvent]:
        """The end of the output: the open block closes."""
        return self._switch(None)

    def _grow(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        events = [] if self.open is not None and self.open.kind == kind else \
            self._switch(Block(kind, len(self.blocks)))
        self.open.text += text
        return events + [BlockEvent("delta", self.open, text)]

    def _switch(self, block: Block | None) -> list[BlockEvent]:
        events = [] if self.open is None else [BlockEvent("close", self.open)]
        self.open = block
        if block is not None:
            self.blocks.append(block)
            events.append(BlockEvent("open", block))
        return events


def final_blocks(deltas: list[dict]) -> list[Block]:
    """The blocks of a whole output (ChatChoice.deltas of its final RequestOutput)."""
    stream = BlockStream()
    stream.feed(deltas)
    stream.close()
    return stream.blocks
