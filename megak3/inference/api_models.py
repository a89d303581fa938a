"""The OpenAI request and response schemas of the HTTP server (megak3/inference/server.py), as pydantic models.

Requests are strict: a JSON ``true`` is not an integer, ``"yes"`` is not a boolean, ``1`` is not a
boolean, an integer is not a string; unknown fields are refused (OpenAI answers "Unrecognized
request argument" too). Every value the server cannot honour exactly is refused rather than
ignored: ``suffix``, ``best_of`` other than 1 (or ``n``), non-zero penalties, a non-empty
``logit_bias``, and ``echo`` except for scoring. ``top_k`` and ``ignore_eos`` are extensions (vLLM has both).
Scoring (completions only): ``echo: true`` with ``max_tokens: 0`` returns each prompt's text and, with
``logprobs: 0``, its tokens' logprobs (the first ``null``, as OpenAI and vLLM answer) at the request's
``temperature`` (megak3/inference/scoring.py); there ``n``, ``stream``, ``top_p``, ``top_k`` and
``logprobs`` > 0 are refused, and so are ``echo`` with ``max_tokens`` other than 0 and ``max_tokens: 0``
without ``echo``. Ranges are OpenAI's:
``temperature`` [0, 2], ``top_p`` (0, 1], ``n`` [1, 16], completions ``logprobs`` [0, 5], chat
``top_logprobs`` [0, 20], at most 4 ``stop`` strings.

Response models (``*Response``, ``*Chunk``) fix the field names and nesting of what the server
returns; their JSON is :meth:`pydantic.BaseModel.model_dump` (``None`` fields appear as ``null``,
as in OpenAI's responses).
"""
from __future__ import annotations

from typing import Annotated, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

MAX_N = 16
MAX_STOP = 4
TokenId = Annotated[StrictInt, Field(ge=0)]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
Unit = Annotated[float, Field(allow_inf_nan=False)]

FIELD_HINTS = {
    "prompt": "must be a string, a non-empty list of strings, of token ids, or of non-empty token-id lists",
    "stop": f"must be a non-empty string or a list of at most {MAX_STOP} non-empty strings",
    "messages": "must be a non-empty list of {\"role\", \"content\"} objects",
}
"""one-line fixes for fields whose type is a union (pydantic's own message lists every branch)"""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Sampling(_Strict):
    """Fields that completions and chat completions share."""

    model: Optional[StrictStr] = None
    max_tokens: Optional[Annotated[StrictInt, Field(ge=0)]] = None   # 0: completions' echo scoring only
    temperature: Optional[Annotated[Unit, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[Unit, Field(gt=0, le=1)]] = None
    top_k: Optional[Annotated[StrictInt, Field(ge=0)]] = None
    seed: Optional[Annotated[StrictInt, Field(ge=0, lt=2 ** 63)]] = None
    stop: Optional[Union[NonEmptyStr, Annotated[List[NonEmptyStr], Field(max_length=MAX_STOP)]]] = None
    n: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_N)]] = None
    stream: Optional[StrictBool] = None
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Annotated[Unit, Field(ge=-2, le=2)]] = None
    frequency_penalty: Optional[Annotated[Unit, Field(ge=-2, le=2)]] = None
    logit_bias: Optional[Dict[StrictStr, Annotated[Unit, Field(ge=-100, le=100)]]] = None
    user: Optional[StrictStr] = None
    ignore_eos: Optional[StrictBool] = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        if self.max_tokens == 0 and not getattr(self, "echo", False):
            raise UnsupportedField("max_tokens", "max_tokens must be >= 1 (0 only with echo=true, which scores "
                                   "the prompt)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise UnsupportedField(name, f"{name} is not supported; use 0")
        if self.logit_bias:
            raise UnsupportedField("logit_bias", "logit_bias is not supported; leave it out")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options is only allowed with stream=true")
        return self


class UnsupportedField(ValueError):
    """A well-typed field whose value the server cannot honour (``param`` names it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, Annotated[List[StrictStr], Field(min_length=1)],
                  Annotated[List[TokenId], Field(min_length=1)],
                  Annotated[List[Annotated[List[TokenId], Field(min_length=1)]], Field(min_length=1)]]
    logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=5)]] = None
    echo: Optional[StrictBool] = None
    suffix: Optional[StrictStr] = None
    best_of: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_N)]] = None

    @model_validator(mode="after")
    def _refuse_completion_only(self):
        if self.echo:
            if self.max_tokens != 0:
                raise UnsupportedField("echo", "echo is supported with max_tokens=0 only (scoring the prompt: "
                                       "its tokens' logprobs with logprobs=0); set max_tokens to 0 or leave echo out")
            for name, bad, fix in (("n", (self.n or 1) != 1, "use 1"), ("stream", bool(self.stream), "use false"),
                                   ("top_p", self.top_p not in (None, 1), "leave it out (logprobs are of "
                                    "softmax(logits / temperature))"),
                                   ("top_k", bool(self.top_k), "leave it out (logprobs are of "
                                    "softmax(logits / temperature))"),
                                   ("logprobs", bool(self.logprobs), "use 0 (no top alternatives of prompt tokens)")):
                if bad:
                    raise UnsupportedField(name, f"{name} is not supported with echo (prompt scoring); {fix}")
        if self.suffix:
            raise UnsupportedField("suffix", "suffix is not supported; leave it out")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise UnsupportedField("best_of", "best_of must equal n (no server-side best-of selection)")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Strict):
    url: NonEmptyStr
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[StrictStr, Annotated[List[ContentPart], Field(min_length=1)]]
    name: Optional[StrictStr] = None
    tool_call_id: Optional[StrictStr] = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[List[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=20)]] = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs=true")
        return self


# ------------------------------------------------------------------------------------------ responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: List[str]
    token_logprobs: List[Optional[float]]           # echo: the prompt's first token has none (null)
    top_logprobs: Optional[List[Optional[Dict[str, float]]]]
    text_offset: List[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[Literal["stop", "length"]]
    logprobs: Optional[CompletionLogprobs] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: List[int]


class TokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob]


class ChatLogprobs(BaseModel):
    content: List[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: Optional[Literal["stop", "length"]] = None
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "megak3"
    max_model_len: int
    vocab_size: int
    """the model's vocabulary size (extension: what a trainer checks a served MOPD teacher by)"""
    tokenizer_sha256: str
    """SHA-256 of the serialised tokenizer.json (megak3.data.tokenizer.Tokenizer.sha256; extension)"""
    special_ids: Dict[str, int]
    """pad / bos / eos / media token ids (extension)"""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody
