"""Tool calls, and the server-wide thinking switch, on a random Qwen3 with the real Qwen3 tokenizer
and chat template, through the official openai client, streamed and not; and the Hermes parser
alone on tricky inputs.

The model is the steered one of test_server_reasoning (thinking on it says
"<think>Sunlight scatters</think>\\n\\nBlue wins!", thinking off "Blue wins!"). Calls come from the
grammar: tool_choice "required" or a named function is enforced by xgrammar, and in "auto" mode an
``ebnf`` field makes the model write a scripted reply with two calls.
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import QWEN_TOKENIZER_DIR, make_hf_model
from test_server_reasoning import QUESTION, steer

from polychip.config import ServerConfig
from polychip.errors import InvalidRequestError
from polychip.models.tokenizer import Tokenizer
from polychip.http.launcher import ServerProcess
from polychip.server.tool_calls import plan_tools, template_messages
from polychip.server.tool_parsers import HermesToolParser, detect_parser, parse_tool_calls

WEATHER = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "London"]}, "unit": {"type": "string", "enum": ["C", "F"]}}}
TIME = {"type": "object", "required": ["tz"], "properties": {"tz": {"type": "string", "maxLength": 8}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
CALL_1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
SCRIPT = "Let me check.\n" + CALL_1 + "\n" + CALL_2


def ebnf_exactly(text: str) -> str:
    return "root ::= " + json.dumps(text)


# the parser alone
@pytest.mark.parametrize("text,content,calls", [
    ("Hello there.\n", "Hello there.\n", []),                          # no calls: the text as written
    (SCRIPT, "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    (CALL_1 + CALL_2, "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ('<tool_call>\n{"name": "f", "arguments": {bad json}}\n</tool_call>\nafter',
     '<tool_call>\n{"name": "f", "arguments": {bad json}}\n</tool_call>\nafter', []),   # invalid JSON stays text
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ("before " + CALL_1 + " after", "before after", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("f", {"x": 1})]),  # string args
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', "", [("f", {"x": 1})]),     # unclosed but complete
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),      # unclosed, incomplete
    ("a <tool_ca", "a <tool_ca", []),                                  # a partial tag at the end is text
    ('x</tool_call>', 'x</tool_call>', []),
])
def test_parser_whole_and_every_split(text, content, calls):
    got_content, got_calls = parse_tool_calls(HermesToolParser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for cut in range(len(text) + 1):                  # any two deltas give the same result
        p = HermesToolParser()
        parts = [p.feed(text[:cut]), p.feed(text[cut:]), p.finish()]
        assert "".join(c for c, _ in parts) == content, cut
        assert [(c.name, json.loads(c.arguments)) for _, cs in parts for c in cs] == calls, cut
    p = HermesToolParser()                            # one character at a time
    parts = [p.feed(ch) for ch in text] + [p.finish()]
    assert "".join(c for c, _ in parts) == content


def test_parser_max_calls_keeps_the_first():
    content, calls = parse_tool_calls(HermesToolParser, CALL_1 + CALL_2, max_calls=1)
    assert [c.name for c in calls] == ["get_weather"] and content == CALL_2
    ids = {c.id for c in parse_tool_calls(HermesToolParser, SCRIPT)[1]}
    assert len(ids) == 2 and all(i.startswith("call_") for i in ids)


# the request side
@pytest.fixture(scope="module")
def qwen_tok():
    return Tokenizer.from_dir(QWEN_TOKENIZER_DIR)


def test_parser_detected_from_the_template(qwen_tok):
    assert detect_parser(qwen_tok.chat_template) == "qwen25"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_history_with_tool_calls_renders_through_the_template(qwen_tok):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    text = qwen_tok.apply_chat_template(template_messages(history), tools=TOOLS)
    assert CALL_1 in text                               # arguments went in as an object, not a string
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in text
    assert '"name": "get_time"' in text.split("\n</tools>")[0]    # the tools are in the system prompt
    bad = [history[0], {**history[1], "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}]
    with pytest.raises(InvalidRequestError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        template_messages(bad)


@pytest.mark.parametrize("tools,choice,needle", [
    (None, "required", "tool_choice 'required' needs tools"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "names the function 'nope'"),
    (TOOLS, "sometimes", "tool_choice must be"),
    ([{"type": "retrieval"}], "auto", r"tools\[0\].type must be 'function'"),
    ([{"type": "function", "function": {"name": "a b"}}], "auto", r"tools\[0\].function.name"),
    ([TOOLS[0], TOOLS[0]], "auto", "given twice"),
])
def test_bad_tools_and_choices(tools, choice, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        plan_tools(tools, choice, True, "qwen25", None, "")


def test_tools_without_a_known_format_are_refused(qwen_tok):
    renders_tools = "{{ tools }}{{ messages }}"
    with pytest.raises(InvalidRequestError, match="--tool-call-parser"):
        plan_tools(TOOLS, "auto", True, None, renders_tools, "")
    assert plan_tools(TOOLS, "none", True, None, renders_tools, "").parser_cls is None
    assert plan_tools(TOOLS, "auto", True, "qwen25", renders_tools, "").parser_cls is not None
    for choice in ("auto", "none"):          # SmolLM2's template ignores tools: refused, not dropped
        with pytest.raises(InvalidRequestError, match="does not render tools"):
            plan_tools(TOOLS, choice, True, "qwen25", "{% for m in messages %}{{ m.content }}{% endfor %}", "")


def test_server_wide_thinking_defaults():
    import argparse

    from polychip.flags import add_config_args, config_from_args
    p = argparse.ArgumentParser()
    add_config_args(p, ServerConfig)
    cfg = config_from_args(p.parse_args(["--default-chat-template-kwargs", '{"enable_thinking": false}']), ServerConfig)
    assert cfg.chat_template_defaults() == {"enable_thinking": False}
    cfg = config_from_args(p.parse_args(["--enable-thinking", "false", "--tool-call-parser", "qwen"]), ServerConfig)
    assert (cfg.chat_template_defaults(), cfg.tool_call_parser) == ({"enable_thinking": False}, "qwen")
    for bad in (["--enable-thinking", "maybe"], ["--default-chat-template-kwargs", "{nope"],
                ["--default-chat-template-kwargs", "[1]"], ["--tool-call-parser", "hermes2"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    assert ServerConfig(enable_thinking=False).chat_template_defaults() == {"enable_thinking": False}
    both = ServerConfig(default_chat_template_kwargs={"enable_thinking": True, "x": 1}, enable_thinking=False)
    assert both.chat_template_defaults() == {"enable_thinking": False, "x": 1}
    with pytest.raises(Exception, match="cannot set"):
        ServerConfig(default_chat_template_kwargs={"tools": []})


# the server
@pytest.fixture(scope="module")
def client(tmp_path_factory, device_args):
    path = steer(make_hf_model(str(tmp_path_factory.mktemp("qwen3-tools")), "qwen3", tie=False))
    with ServerProcess(["--model-path", path, "--served-model-name", "qwen3-tiny", "--max-total-tokens", "4096",
                        "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25",
                        "--enable-thinking", "false", *device_args]) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)


def ask(client, stream=False, **kw):
    kw = {"model": "qwen3-tiny", "messages": QUESTION, "temperature": 0, "max_tokens": 300, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return m.content, (m.model_extra or {}).get("reasoning_content"), calls, r.choices[0].finish_reason
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
        for tc in c.delta.tool_calls or []:     # OpenAI's deltas: id, type and name first, arguments appended
            entry = calls.setdefault(tc.index, [None, None, ""])
            entry[0] = tc.id or entry[0]
            entry[1] = (tc.function.name if tc.function else None) or entry[1]
            entry[2] += (tc.function.arguments or "") if tc.function else ""
        finish = c.finish_reason or finish
    return content or None, reasoning or None, [tuple(calls[i]) for i in sorted(calls)], finish


def check_calls(calls):
    for call_id, name, args in calls:
        assert call_id.startswith("call_")
        jsonschema.validate(json.loads(args), SCHEMA_OF[name])


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_is_forced_by_the_grammar(client, stream):
    content, reasoning, calls, finish = ask(
        client, stream, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [name for _, name, _ in calls] == ["get_time"]
    check_calls(calls)
    assert finish == "tool_calls" and content is None and reasoning is None


@pytest.mark.parametrize("stream", [False, True])
def test_required_with_thinking_on_gives_reasoning_and_a_valid_call(client, stream):
    content, reasoning, calls, finish = ask(client, stream, tools=TOOLS, tool_choice="required",
                                            extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert reasoning == "Sunlight scatters"
    assert len(calls) >= 1 and finish == "tool_calls"
    check_calls(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_two_calls_and_the_text_around_them(client, stream):
    content, _, calls, finish = ask(client, stream, tools=TOOLS, extra_body={"ebnf": ebnf_exactly(SCRIPT)})
    assert content == "Let me check."
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Paris"}),
                                                         ("get_time", {"tz": "CET"})]
    assert len({i for i, _, _ in calls}) == 2 and finish == "tool_calls"


def test_parallel_tool_calls_false_stops_after_the_first(client):
    for stream in (False, True):
        content, _, calls, finish = ask(client, stream, tools=TOOLS, parallel_tool_calls=False,
                                        extra_body={"ebnf": ebnf_exactly(SCRIPT)})
        assert [n for _, n, _ in calls] == ["get_weather"] and content == "Let me check." and finish == "tool_calls"


def test_tool_choice_none_leaves_the_text_alone(client):
    content, _, calls, finish = ask(client, tools=TOOLS, tool_choice="none", extra_body={"ebnf": ebnf_exactly(SCRIPT)})
    assert content == SCRIPT and calls == [] and finish == "stop"


def test_history_with_calls_and_results_is_served(client):
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]
    r = client.chat.completions.create(model="qwen3-tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=5)
    tok = Tokenizer.from_dir(QWEN_TOKENIZER_DIR)
    text = tok.apply_chat_template(template_messages([{**m, "content": m["content"] or ""} for m in history]),
                                   tools=TOOLS, enable_thinking=False)
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("kw,needle", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": "no"}}]}, "parameters must be"),
])
def test_bad_tool_requests_are_400s(client, kw, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        client.chat.completions.create(model="qwen3-tiny", messages=QUESTION, max_tokens=5, **kw)


# thinking, server-wide: the server runs with --enable-thinking false
def test_server_default_turns_thinking_off_and_the_request_wins(client):
    content, reasoning, _, _ = ask(client, max_tokens=20)
    assert (content, reasoning) == ("Blue wins!", None)
    for stream in (False, True):
        content, reasoning, _, _ = ask(client, stream, max_tokens=20,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert (content, reasoning) == ("Blue wins!", "Sunlight scatters")
