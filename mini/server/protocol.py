"""OpenAI request bodies (the fields mini honours) and their translation to SamplingParams, prompts and grammars.

Every field is either honoured or refused: a field mini does not know, or knows and does not support, is a 400
that names it (`extra="forbid"`); wrong types and out-of-range values are errors that name the field. The README's
API section lists the fields.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mini.engine import SamplingParams

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        """A field sent as null asks for nothing: it is the field left out (clients send `"temperature": null`, and
        messages dumped from a response carry `"refusal": null, "audio": null, "function_call": null`)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    user: str | None = None  # an end-user id for the caller's own records: nothing to do here

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        if v is not None and v != 1:
            raise ValueError("best_of is not supported (use n to get several samples)")
        return v

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return v

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v):
        if v is not None and not -(1 << 63) <= v < (1 << 63):
            raise ValueError("seed must fit in 64 bits")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, value in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return v

    def sampling_params(self, max_tokens_default: int | None, n_logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the bad value."""
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_tokens=self.max_tokens if self.max_tokens is not None else max_tokens_default, stop=self.stop,
            stop_token_ids=self.stop_token_ids, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logprobs=n_logprobs, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request is supported (got a batch)")
            v = v[0]
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v


# ------------------------------------------------------------------------------------------ chat
class FunctionCall(_Strict):
    name: str
    arguments: str | dict


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    name: str | None = None  # tool only (redundant with tool_call_id); other roles have no name in V4.1's format
    reasoning_content: str | None = None  # assistant (also accepted as `reasoning`)
    reasoning: str | None = None
    refusal: str | None = None  # assistant: must be empty, V4.1 has no refusal field

    @model_validator(mode="after")
    def _fields_fit_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.name is not None and self.role != "tool":
            raise ValueError(f"'name' is not supported on {self.role} messages (V4.1's format has no names)")
        if (self.reasoning_content or self.reasoning) and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if self.refusal:
            raise ValueError("'refusal' is not supported")
        return self

    def for_prompt(self) -> dict:
        """The message as mini.tokenizer.render_chat takes it."""
        msg: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.reasoning_content or self.reasoning:
            msg["reasoning_content"] = self.reasoning_content or self.reasoning
        return msg


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs 'json_schema'")
        return self


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None  # kept as sent: the prompt writes each function object with its key order
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["low", "medium", "high", "max", "none"] | int | None = None
    thinking: bool = False  # V4.1 thinking mode (also read from chat_template_kwargs)
    chat_template_kwargs: dict | None = None

    @field_validator("tools")
    @classmethod
    def _tools_shape(cls, v):
        for i, tool in enumerate(v or []):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools[{i}].function needs a name")
            if set(fn) - {"name", "description", "parameters", "strict"}:
                raise ValueError(f"tools[{i}].function has unsupported fields {sorted(set(fn) - {'name', 'description', 'parameters', 'strict'})}")
            if "parameters" in fn and not isinstance(fn["parameters"], dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        names = [t["function"]["name"] for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _known_kwargs(cls, v):
        unknown = set(v or {}) - {"thinking", "enable_thinking", "reasoning_effort"}
        if unknown:
            raise ValueError(f"unsupported chat_template_kwargs {sorted(unknown)}")
        return v

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        if self.forced_tool_call and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("a forced tool call and a response_format cannot both be enforced")
        return self

    @property
    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools or []}

    @property
    def forced_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def parses_tool_calls(self) -> bool:
        """The output is read for calls: tools are offered and not switched off (auto, required or named).
        `grammar()` then makes any calls block well-formed, so calls stream as they are decoded."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def thinking_mode(self) -> bool:
        kw = self.chat_template_kwargs or {}
        if self.effort == "none":
            return False
        return bool(kw.get("thinking", kw.get("enable_thinking", self.thinking)))

    @property
    def effort(self):
        """reasoning_effort ("medium" is OpenAI's default level: V4.1's default, "high")."""
        e = (self.chat_template_kwargs or {}).get("reasoning_effort", self.reasoning_effort)
        return "high" if e == "medium" else e

    def prompt(self) -> str:
        """The V4.1 prompt (ValueError names what cannot be rendered)."""
        from mini.tokenizer import render_chat
        effort = None if self.effort == "none" else self.effort
        return render_chat([m.for_prompt() for m in self.messages], thinking=self.thinking_mode,
                           reasoning_effort=effort, tools=self.tools or None)

    def grammar(self) -> str | None:
        """What decoding must follow. With tools (tool_choice not "none"), a well-formed calls block: forced
        (required / named), or under auto free content (the response_format's JSON, if any) or a block. Else the
        response_format, if any; a request without tools and format has none (decoding as without grammars)."""
        from mini.server import grammars
        thinking = self.thinking_mode
        fmt = self.response_format
        schema = None if fmt is None or fmt.type == "text" else \
            (fmt.json_schema.schema_ or {} if fmt.type == "json_schema" else {"type": "object"})
        if self.forced_tool_call:
            only = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
            return grammars.tool_call_grammar(self.tools, only, self.parallel_tool_calls, thinking)
        if self.parses_tool_calls:  # auto
            return grammars.tool_call_grammar(self.tools, None, self.parallel_tool_calls, thinking, optional=True,
                                              content_schema=schema)
        return None if fmt is None or fmt.type == "text" else grammars.json_grammar(schema, thinking)
