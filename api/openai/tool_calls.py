"""Tool calls read out of a chat choice's text, as OpenAI deltas, streaming or not.

One parser per choice (`ToolCallParser`) turns text pieces into OpenAI `delta` dicts:
`{"content": ...}` for plain text, `{"tool_calls": [{"index", "id", "type", "function":
{"name", "arguments"}}]}` for calls (id and name once, arguments in pieces). A non-streaming
response is the same deltas merged (`merge_deltas`), so both paths share one parser.

`auto` reads every family's syntax (`shared/tool_format.py`), whatever the model's own:
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks anywhere in the text,
streamed as they come; and a message that is exactly a call (or a list of calls) to declared
tools: bare JSON (`"arguments"` or Llama's `"parameters"`, several joined by `;`), in a
```json fence, after `<|python_tag|>`, `[TOOL_CALLS]` or `functools`, or inside
`<|tool_call|>...<|/tool_call|>`. Such a message is held back while streaming until it ends
(a message that only starts like one is sent as text then). `required`: a JSON array of
`{"name", "parameters"}` (grammar-forced); `named`: the whole answer is the arguments of the
named function (grammar-forced).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from shared.contracts import ToolCallSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# How a whole-message call may begin (after optional whitespace); special tokens appear only
# where the detokenizer keeps them.
_WHOLE_START = re.compile(
    r"(```(?:json)?\s*)?(\{|\[|<\|python_tag\|>|\[TOOL_CALLS\]|<\|tool_call\|>|functools\[)"
)
_WHOLE_OPENERS = ("<|python_tag|>", "[TOOL_CALLS]", "<|tool_call|>", "functools[")
_FENCE_PREFIX = re.compile(r"`{1,2}|```(j(s(o(n)?)?)?)?\s*")
_FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)
_WRAPPED = re.compile(r"<\|tool_call\|>(.*?)(?:<\|/tool_call\|>)?", re.S)
_NAME_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TRAILING = re.compile(r"[\s}]*$")


def call_id(job_id: str, index: int, number: int) -> str:
    """A stable id per call (the same on every poll of a job and after a restart)."""
    digest = hashlib.sha256(f"{job_id}:{index}:{number}".encode()).hexdigest()
    return "call_" + digest[:24]


class ToolCallParser:
    """Feeds one choice's text; yields OpenAI deltas."""

    def __init__(self, spec: ToolCallSpec, job_id: str, index: int) -> None:
        self.spec = spec
        self._job_id, self._index = job_id, index
        self._text = ""  # everything received
        self._pos = 0  # how much of it is handled
        self._calls = 0
        self._sent_args = 0  # argument characters sent for the open hermes call
        self._call_open = False
        self._name_sent = False

    @property
    def has_calls(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        if self.spec.mode == "named":
            return self._named(text)
        if self.spec.mode == "auto" and self._whole() is False:
            return self._hermes(final=False)
        return []  # required, or a possible whole-message call: read whole at the end

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for whatever is left once the choice ended."""
        if self.spec.mode == "named":
            return []
        if self.spec.mode == "auto":
            calls = _exact_calls(self._text, self.spec.names) if self._whole() else None
            if calls is None:
                return self._hermes(final=True)
            self._pos = len(self._text)
            return [self._call(name, args) for name, args in calls]
        rest = self._text[self._pos :]
        self._pos = len(self._text)
        calls = _json_calls(rest, self.spec.mode == "required")
        if calls is None:
            return [{"content": rest}] if rest else []
        return [self._call(name, args) for name, args in calls]

    def _whole(self) -> bool | None:
        """Whether the message may be one whole call (held back), is not (streamed), or
        cannot be told yet (None). Decided once, at the start of the text."""
        if self._pos or self._calls:
            return False
        head = self._text.lstrip()
        if _WHOLE_START.match(head):
            return True
        could_be = _FENCE_PREFIX.fullmatch(head) or any(o.startswith(head) for o in _WHOLE_OPENERS)
        return None if could_be else False

    def _call(self, name: str | None, arguments: str) -> dict[str, Any]:
        """A tool_calls delta: a new call (with a name) or more arguments for the last one."""
        if name is not None:
            self._calls += 1
        entry: dict[str, Any] = {"index": self._calls - 1}
        if name is not None:
            entry.update(id=call_id(self._job_id, self._index, self._calls), type="function")
            entry["function"] = {"name": name, "arguments": arguments}
        else:
            entry["function"] = {"arguments": arguments}
        return {"tool_calls": [entry]}

    def _named(self, text: str) -> list[dict[str, Any]]:
        if not self._calls:
            return [self._call(self.spec.function or "", text)]
        return [self._call(None, text)] if text else []

    def _hermes(self, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while True:
            progressed = self._hermes_call(final) if self._call_open else self._content(final)
            if not progressed:
                return deltas
            deltas.extend(delta for delta in progressed if delta)

    def _content(self, final: bool) -> list[dict[str, Any]] | None:
        """Plain text up to the next <tool_call>. Held back while streaming: a possible
        partial tag and trailing whitespace (dropped if only whitespace lies between calls)."""
        rest = self._text[self._pos :]
        start = rest.find(OPEN)
        if start >= 0:
            self._pos += start + len(OPEN)
            self._call_open, self._sent_args, self._name_sent = True, 0, False
            before = rest[:start].rstrip()
            return [{"content": before}] if before else [{}]
        text = rest if final else rest[: len(rest) - _partial_suffix(rest, OPEN)].rstrip()
        if not text:
            return None
        self._pos += len(text)
        return [{"content": text}] if text.strip() or not self._calls else [{}]

    def _hermes_call(self, final: bool) -> list[dict[str, Any]] | None:
        """The open call: name once known, arguments as they come, the rest at </tool_call>."""
        body = self._text[self._pos :]
        end = body.find(CLOSE)
        closed = end >= 0 or final
        body = body[:end] if end >= 0 else body
        deltas = []
        match = _NAME_PREFIX.match(body)
        if match and not self._name_sent:
            deltas.append(self._call(json.loads(f'"{match.group(1)}"'), ""))
            self._name_sent = True
        if match:
            args = body[match.end() :]
            args = _arguments_text(args) if closed else args[: _held_back(args)]
            if len(args) > self._sent_args:
                deltas.append(self._call(None, args[self._sent_args :]))
                self._sent_args = len(args)
        elif closed:
            deltas.extend(self._whole_call(body))
        if not closed:
            return deltas or None
        self._pos += end + len(CLOSE) if end >= 0 else len(body)
        self._call_open = False
        return deltas or [{}]

    def _whole_call(self, body: str) -> list[dict[str, Any]]:
        """A closed block whose JSON did not start with the name: read it whole."""
        calls = _json_calls(body.strip(), False) or _json_calls(body.strip(), True)
        if calls is None:
            return [{"content": OPEN + body + CLOSE}]
        return [self._call(name, args) for name, args in calls]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (it may continue into it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _held_back(args: str) -> int:
    """Where streamed arguments stop for now: not into a trailing run of `}` and
    whitespace (it may be the call's own closing brace) nor into a partial </tool_call>."""
    cut = len(args) - _partial_suffix(args, CLOSE)
    return _TRAILING.search(args[:cut]).start()  # type: ignore[union-attr]


def _arguments_text(args: str) -> str:
    """The arguments value's exact text in `args` (which ends with the call's `}`)."""
    try:
        _value, end = json.JSONDecoder().raw_decode(args)
    except ValueError:
        return args.rstrip().removesuffix("}").rstrip()
    return args[:end]


def _exact_calls(text: str, names: list[str]) -> list[tuple[str, str]] | None:
    """The calls a whole message is, in any family's syntax, when every one names a
    declared tool (any name when none are known); else None."""
    body = text.strip()
    fenced = _FENCED.fullmatch(body) or _WRAPPED.fullmatch(body)
    body = fenced.group(1).strip() if fenced else body
    for opener in ("[TOOL_CALLS]", "functools"):
        body = body.removeprefix(opener).strip()
    items = _json_calls(body, False) or _json_calls(body, True)
    if not items or (names and any(name not in names for name, _ in items)):
        return None
    return items


def _json_calls(text: str, is_array: bool) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) pairs from a JSON array of calls (`is_array`), or from one
    call or `;`-joined calls; None when the text is not that."""
    items = _json_items(text.strip().removeprefix("<|python_tag|>").strip(), is_array)
    calls = []
    for item in items or []:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        calls.append((item["name"], args if isinstance(args, str) else json.dumps(args)))
    return calls or None


def _json_items(text: str, is_array: bool) -> list[Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        if is_array or ";" not in text:
            return None
        try:
            return [json.loads(part) for part in text.split(";") if part.strip()]
        except ValueError:
            return None
    if is_array:
        return value if isinstance(value, list) else None
    return [value]


def merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message the deltas add up to (the non-streaming response)."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                function = dict(piece["function"])
                calls.append({"id": piece["id"], "type": "function", "function": function})
            else:
                calls[-1]["function"]["arguments"] += piece["function"]["arguments"]
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    else:
        message["content"] = content
    return message
