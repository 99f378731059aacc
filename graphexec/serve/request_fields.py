"""OpenAI / vLLM request fields -> `SamplingParams`, field by field, and OpenAI's error
objects. Nothing here adds semantics: every range check is SamplingParams' or the
executor's, and its ValueError comes back as a 400 naming the request's field."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from graphexec.params import SamplingParams
from graphexec.serve.errors import APIError
from graphexec.serve.tools import ToolChoice, tool_choice
from graphexec.text.grammar import Grammar, compile_error

# request field -> SamplingParams field, where the two mean the same thing
SAME = {name: name for name in (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "stop", "stop_token_ids",
    "n", "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "bad_words",
)}  # fmt: skip
GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar")
# fields we refuse rather than silently ignore: (field, its harmless values)
UNSUPPORTED = {
    "suffix": (None, ""), "best_of": (None, 1),
    "functions": (None, []), "function_call": (None, "none"),
    "use_beam_search": (None, False), "guided_choice": (None,),
    "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
}  # fmt: skip


@dataclass
class Parsed:
    """A checked request: its params, the prompts (token ids) and how to answer."""

    params: SamplingParams
    prompts: list[list[int]]
    stream: bool
    include_usage: bool
    logprobs: bool  # report logprobs in the response
    fields: dict[str, str]  # SamplingParams field -> the request field it came from
    tools: ToolChoice | None = None  # a forced tool choice: the answer is tool_calls
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion
    echo_only: bool = False  # echo with max_tokens 0: one token runs, none is reported
    prompt_logprobs: int | None = None  # report each prompt token's logprob, top-N


def check_unicode(value: Any, path: str = "") -> None:
    """APIError(400) naming the first string (by its path in the body) that holds a lone
    surrogate: JSON can carry one (\\ud800), UTF-8 and the tokenizers cannot."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"{path or 'the body'}: invalid Unicode (a lone surrogate "
                           f"at character {e.start})", path.split(".")[0].split("[")[0]
                           or None) from None  # fmt: skip
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k, path or "the body")
            check_unicode(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_unicode(v, f"{path}[{i}]")


MAX_DEPTH = 64  # arrays and objects nested deeper are a 400 (no request field needs 64)


def too_deep() -> APIError:
    return APIError(400, f"the body nests more than {MAX_DEPTH} levels of arrays and objects")


def check_depth(body: Any) -> None:
    """APIError(400) for a body nested more than MAX_DEPTH levels. Iterative: the checks
    after it walk the body recursively."""
    deepest, todo = 0, [(body, 1)]
    while todo and deepest <= MAX_DEPTH:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    if deepest > MAX_DEPTH:
        raise too_deep()


def parse_request(body: dict[str, Any], prompts: list[list[int]], *, chat: bool,
                  max_seq_len: int, tool_format: str | None = None) -> Parsed:  # fmt: skip
    """Map a /v1/completions (chat=False) or /v1/chat/completions body onto SamplingParams;
    `tool_format`: the chat template's tool-call format (for tool_choice "auto").
    APIError(400) naming the field for anything bad."""
    for name, ok in UNSUPPORTED.items():
        if body.get(name) not in ok and not (name == "best_of" and body.get(name) == body.get("n")):
            raise APIError(400, f"{name} is not supported by this server", name)
    kw: dict[str, Any] = {}
    fields = dict(SAME)
    for name, sp_name in SAME.items():
        if body.get(name) is not None:
            kw[sp_name] = body[name]
    if isinstance(kw.get("logit_bias"), dict):  # float("-100") would pass as a str otherwise
        kw["logit_bias"] = dict(kw["logit_bias"])
        for tok, bias in kw["logit_bias"].items():
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                    or not -100 <= bias <= 100:  # fmt: skip
                raise APIError(400, f"logit_bias[{tok!r}] must be a number in [-100, 100], "
                               f"got {bias!r}", "logit_bias")  # fmt: skip
    for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
        if isinstance(kw.get(name), list):
            kw[name] = tuple(kw[name])
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"  # fmt: skip
    fields["max_tokens"] = limit
    echo = _bool(body, "echo")
    if echo and chat:
        raise APIError(400, "echo is for /v1/completions", "echo")
    echo_only = echo and body.get(limit) == 0 and not isinstance(body.get(limit), bool)
    if echo_only:  # the prompt's logprobs only: one token runs (the prefill's), none shown
        if _bool(body, "stream"):
            raise APIError(400, "echo with max_tokens 0 is not streamed", "stream")
        kw["max_tokens"] = 1
    elif body.get(limit) is not None:
        kw["max_tokens"] = body[limit]
    elif chat:  # OpenAI's chat default: as many as the context holds
        kw["max_tokens"] = max(1, max_seq_len - max(len(p) for p in prompts))
    _check_context(prompts, kw.get("max_tokens"), max_seq_len, chat, limit)
    want_logprobs = _logprobs(body, chat, kw, fields)
    prompt_n = body.get("prompt_logprobs")
    if prompt_n is not None:
        kw["prompt_logprobs"], fields["prompt_logprobs"] = prompt_n, "prompt_logprobs"
    # echo's prompt tokens get logprobs, top-N as the completion's (a bad prompt_logprobs
    # is left for SamplingParams to name)
    if echo and want_logprobs and isinstance(kw.get("prompt_logprobs", 0), int):
        kw["prompt_logprobs"] = max(kw.get("logprobs") or 0, kw.get("prompt_logprobs") or 0)
    if kw.get("prompt_logprobs") is not None and _bool(body, "stream"):
        raise APIError(400, "prompt logprobs (prompt_logprobs, or echo with logprobs) are not "
                       "streamed", "stream")  # fmt: skip
    grammar, source = _grammar(body)
    if not chat and (body.get("tools") is not None or body.get("tool_choice") is not None):
        raise APIError(400, "tools are for /v1/chat/completions", "tools")
    # with tools, the request's grammar shapes the content and the tools the calls
    # (`serve.tools`): the one grammar then holds both
    forced = tool_choice(body, tool_format, grammar) if chat else None
    if forced is not None:
        grammar, source = forced.grammar, "tools"
    if grammar is not None:
        kw["grammar"], fields["grammar"] = grammar, source
    try:
        params = SamplingParams(**kw)
    except ValueError as e:
        raise APIError(400, str(e), param_of(str(e), fields)) from None
    except TypeError as e:  # e.g. a list where a mapping belongs
        raise APIError(400, str(e), None) from None
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    return Parsed(params, prompts, _bool(body, "stream"),
                  bool((opts or {}).get("include_usage")), want_logprobs, fields,
                  forced, echo, echo_only, prompt_n)  # fmt: skip


def _check_context(prompts: list[list[int]], max_tokens: Any, max_seq_len: int, chat: bool,
                   limit: str) -> None:  # fmt: skip
    """As vLLM: a prompt that fills the context, or prompt + max_tokens beyond it, is a
    400 naming the prompt or the max_tokens field (not a silently shortened answer)."""
    field = "messages" if chat else "prompt"
    longest = max(len(p) for p in prompts)
    if longest >= max_seq_len:
        raise APIError(400, f"This model's maximum context length is {max_seq_len} tokens; "
                       f"the {field} {'are' if chat else 'is'} {longest} tokens, leaving no "
                       "room for a completion",
                       field)  # fmt: skip
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0 \
            and longest + max_tokens > max_seq_len:  # fmt: skip
        raise APIError(400, f"This model's maximum context length is {max_seq_len} tokens; "
                       f"you requested {longest + max_tokens} ({longest} in the {field}, "
                       f"{max_tokens} in {limit})", limit)  # fmt: skip


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise APIError(400, f"{name} must be a bool, got {v!r}", name)
    return bool(v)


def _logprobs(body: dict[str, Any], chat: bool, kw: dict[str, Any], fields: dict) -> bool:
    """completions: logprobs is N (the top-N); chat: logprobs is a bool, top_logprobs N."""
    if not chat:
        if body.get("logprobs") is None:
            return False
        kw["logprobs"], fields["logprobs"] = body["logprobs"], "logprobs"
        return True
    on, top = _bool(body, "logprobs"), body.get("top_logprobs")
    if top is not None and not on:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if on:
        kw["logprobs"], fields["logprobs"] = (0 if top is None else top), "top_logprobs"
    return on


def _grammar(body: dict[str, Any]) -> tuple[Grammar | None, str | None]:
    given = [f for f in GRAMMAR_FIELDS if body.get(f) is not None]
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") == "text"):
        if not isinstance(rf, dict):
            raise APIError(400, "response_format must be an object", "response_format")
        given.remove("response_format")
    if len(given) > 1:
        raise APIError(400, f"give at most one of {', '.join(given)}", given[1])
    if not given:
        return None, None
    name = given[0]
    v = body[name]
    try:
        if name == "response_format":
            kind = v.get("type")
            if kind == "json_object":
                return Grammar.json(), name
            if kind != "json_schema":
                raise APIError(400, f"response_format.type must be 'text', 'json_object' or "
                               f"'json_schema', got {kind!r}", name)  # fmt: skip
            schema = (v.get("json_schema") or {}).get("schema")
            if not isinstance(schema, (dict, str)):
                raise APIError(400, "response_format.json_schema.schema must be a JSON schema "
                               "object", name)  # fmt: skip
            return Grammar.json_schema(schema), name
        if name == "guided_json":
            if not isinstance(v, (dict, str)):
                raise APIError(400, "guided_json must be a JSON schema (object or str)", name)
            return Grammar.json_schema(v), name
        if not isinstance(v, str):
            raise APIError(400, f"{name} must be a str", name)
        return (Grammar.regex(v) if name == "guided_regex" else Grammar.ebnf(v)), name
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 (any failure to compile the user's grammar)
        raise APIError(400, f"{name}: {compile_error(e)}", name) from None


_LEAD = re.compile(r"^(?:params\.)?([a-z_]+)")


def param_of(message: str, fields: dict[str, str], prompt_field: str = "prompt") -> str | None:
    """The request field a SamplingParams / add_request ValueError names (its first word,
    as those messages start with the field), mapped back to the request's name for it."""
    m = _LEAD.match(message)
    if m is None:
        return None
    name = m.group(1)
    if name == "prompt_token_ids":
        return prompt_field
    return fields.get(name)


def model_not_found(name: Any) -> APIError:
    return APIError(404, f"The model {name!r} does not exist.", "model",
                    code="model_not_found")  # fmt: skip
