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


class FieldError(ValueError):
    """A check across fields (a model validator) that names the field to blame: the error's `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


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
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far
    include_obfuscation: bool = False  # OpenAI pads chunks against length side channels; a hint here (no padding)


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (and its older top-level `guided_*` fields): exactly one constraint."""
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json", "regex", "choice", "json_object") if self.get(k) not in (None, False)]
        if len(given) != 1:
            raise FieldError("give exactly one of json, regex, choice, json_object "
                             f"(got {', '.join(given) if given else 'none'})", "structured_outputs")
        if isinstance(self.json_, str):
            import json
            try:
                self.json_ = json.loads(self.json_)
            except ValueError:
                raise ValueError("json must be a JSON schema (an object, or its JSON text)") from None
            if not isinstance(self.json_, dict):
                raise ValueError("json must be a JSON schema object")
        return self

    def get(self, key: str):
        return self.json_ if key == "json" else getattr(self, key)

    def grammar(self, thinking: bool = False) -> str:
        from mini.server import grammars
        if self.regex is not None:
            return grammars.regex_grammar(self.regex, thinking)
        if self.choice is not None:
            return grammars.choice_grammar(self.choice, thinking)
        return grammars.json_grammar(self.json_ if self.json_ is not None else None, thinking)


SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")


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
    min_tokens: int = Field(0, ge=0)  # vLLM: EOS and stop_token_ids cannot end the output before this many tokens
    skip_special_tokens: bool = True  # vLLM: False keeps BOS / EOS / pad in the text
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs name tokens "token_id:N"
    structured_outputs: StructuredOutputs | None = None  # vLLM's constraint (json, regex, choice, json_object)
    guided_json: dict | str | None = None  # vLLM's older names of structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # hints and the caller's records: accepted, nothing in V4.1 or one server acts on them
    user: str | None = None  # an end-user id
    safety_identifier: str | None = Field(None, max_length=64)  # OpenAI's successor of `user`
    metadata: dict[str, str] | None = None  # up to 16 pairs (OpenAI's limits), echoed where OpenAI echoes it
    store: bool | None = None  # OpenAI's stored completions; chat completions are not stored here
    service_tier: Literal[SERVICE_TIERS] | None = None  # one tier here: answered as "default"
    prompt_cache_key: str | None = None  # prefix caching is automatic: the key changes nothing

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v):
        return check_metadata(v)

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

    @model_validator(mode="after")
    def _one_structured_output(self):
        guided = {k: getattr(self, k) for k in ("guided_json", "guided_regex", "guided_choice")
                  if getattr(self, k) is not None}
        if len(guided) + (self.structured_outputs is not None) > 1:
            raise FieldError(f"give one of structured_outputs, guided_json, guided_regex, guided_choice "
                             f"(got {', '.join([*(['structured_outputs'] if self.structured_outputs else []), *guided])})",
                             list(guided)[-1])
        if guided:
            (key, value), = guided.items()
            self.structured_outputs = StructuredOutputs.model_validate({key.removeprefix("guided_"): value})
        return self

    def sampling_params(self, max_tokens_default: int | None, n_logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the bad value."""
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        max_tokens = self.max_tokens if self.max_tokens is not None else max_tokens_default
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})")
        return SamplingParams(min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_tokens=max_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logprobs=n_logprobs, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512."""
    if v is None:
        return v
    if len(v) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} metadata pairs, got {len(v)}")
    for key, value in v.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise ValueError(f"metadata keys take up to {MAX_METADATA_KEY} characters and values up to "
                             f"{MAX_METADATA_VALUE} (key {key[:64]!r})")
    return v


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

    @model_validator(mode="after")
    def _echo_without_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise FieldError("echo with logprobs needs the prompt's logprobs, which this server does not compute",
                             "echo")
        return self

    def grammar(self) -> str | None:
        return None if self.structured_outputs is None else self.structured_outputs.grammar()


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
    name: str | None = None  # a hint: V4.1's format has no place for a speaker's name (tool: tool_call_id names it)
    reasoning_content: str | None = None  # assistant (also accepted as `reasoning`)
    reasoning: str | None = None
    refusal: str | None = None  # assistant: must be empty, V4.1 has no refusal field

    @model_validator(mode="after")
    def _fields_fit_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if (self.reasoning_content or self.reasoning) and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if self.refusal:
            raise ValueError("'refusal' is not supported")
        return self

    def for_prompt(self) -> dict:
        """The message as mini.chat_format.render_chat takes it."""
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


# OpenAI's reasoning levels mapped to V4.1's nearest (mini.chat_format.EFFORT_PRESETS: low 50, high 75, max 100):
# "medium" is OpenAI's default level, as "high" is V4.1's; "minimal" is below V4.1's lowest preset, "xhigh" above
# its default
EFFORT_ALIASES = {"minimal": "low", "medium": "high", "xhigh": "max"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def check_effort(v):
    """A reasoning effort: one of REASONING_EFFORTS or an integer 1..100 (ValueError listing them)."""
    ok = v is None or v in REASONING_EFFORTS or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 100)
    if not ok:
        raise ValueError(f"expected one of {', '.join(REASONING_EFFORTS)} or an integer 1-100, got {v!r}")
    return v


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None  # kept as sent: the prompt writes each function object with its key order
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_effort: str | int | None = None  # REASONING_EFFORTS or 1..100
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: V4.1 has no length control
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
        if v and v.get("reasoning_effort") is not None:
            check_effort(v["reasoning_effort"])
        return v

    @field_validator("reasoning_effort")
    @classmethod
    def _known_effort(cls, v):
        return check_effort(v)

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise FieldError("tool_choice needs tools", "tool_choice")
        if self.structured_outputs is not None and (self.parses_tool_calls or (
                self.response_format is not None and self.response_format.type != "text")):
            raise FieldError("structured_outputs cannot be combined with tools or a response_format",
                             "structured_outputs")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names:
            raise FieldError(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                             "tool_choice")
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
        """reasoning_effort as V4.1 takes it (EFFORT_ALIASES: OpenAI's levels to V4.1's nearest)."""
        e = (self.chat_template_kwargs or {}).get("reasoning_effort", self.reasoning_effort)
        return EFFORT_ALIASES.get(e, e)

    def prompt(self) -> str:
        """The V4.1 prompt (ValueError names what cannot be rendered)."""
        from mini.chat_format import render_chat
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
        if self.forced_tool_call:  # the output is calls: a response_format, for text answers, has nothing to shape
            only = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
            return grammars.tool_call_grammar(self.tools, only, self.parallel_tool_calls, thinking)
        if self.parses_tool_calls:  # auto
            return grammars.tool_call_grammar(self.tools, None, self.parallel_tool_calls, thinking, optional=True,
                                              content_schema=schema)
        if self.structured_outputs is not None:
            return self.structured_outputs.grammar(thinking)
        return None if fmt is None or fmt.type == "text" else grammars.json_grammar(schema, thinking)
