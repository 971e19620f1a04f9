#!/usr/bin/env python3
"""Renders the chat templates of this folder with jinja2 as transformers
renders them, for tests/test_chat.c: tidal's interpreter must give the same
text (or fail with the same raise_exception message) on every case.

The environment is transformers' (utils/chat_template_utils.py):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the
loopcontrols extension, transformers' tojson filter (json.dumps with
ensure_ascii off), raise_exception() and strftime_now(); the variables are
messages, tools (None when absent), documents (None), add_generation_prompt
and the special tokens.  strftime_now reads a fixed clock (CLOCK, UTC) so
that the fixtures do not change with the day; the test sets the same clock.

    python3 tests/data/chat/gen_chat_fixtures.py   # writes cases.jsonl beside it
"""
import json
import os
import random
from datetime import datetime, timezone

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
CLOCK = 1736942400  # 2025-01-15 12:00:00 UTC

# The special tokens each family's tokenizer_config.json names.
FAMILIES = {
    "llama3.1.jinja": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "llama3.2.jinja": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen2.5.jinja": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "mistral-v0.1.jinja": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "mistral-v0.3.jinja": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "smollm2.jinja": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"},
    "gemma2.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "gemma3.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
}

TEXTS = [
    "Hi",
    "",
    "  padded with spaces  ",
    "What is 2 + 2?",
    "Multi\nline\n\ntext with a blank line\n",
    "unicode: héllo wörld, 世界, ελληνικά, кириллица 🙂👍🏽",
    "\u00a0nbsp and ideographic\u3000space\u2028line separator ",
    "quotes \" and ' and {{ not a tag }} {% nor this %} {# nor this #}",
    "tabs\tand\\backslashes\\n (a literal backslash-n)",
    "trailing newline\n",
    "\n\nleading newlines",
    "emoji only 🎉🎉🎉",
    "A longer answer. " * 12,
    "<|im_end|> looks like a special token",
    "JSON in text: {\"a\": [1, 2.5, null, true]}",
    "é composed vs e\u0301 decomposed",
]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                       "parameters": {"type": "object", "properties": {
                                           "city": {"type": "string", "description": "the city"},
                                           "unit": {"type": "string", "enum": ["C", "F"]}},
                                           "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Adds two numbers",
                                       "parameters": {"type": "object", "properties": {
                                           "a": {"type": "number"}, "b": {"type": "number", "default": 1.5}}}}},
]


def environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.fromtimestamp(CLOCK, timezone.utc).strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def text(rng):
    return rng.choice(TEXTS)


def plain_conversation(rng, system, turns, end_with_user, parts=False):
    msgs = []
    if system:
        msgs.append({"role": "system", "content": text(rng) or "You are terse."})
    for t in range(turns):
        user = text(rng)
        if parts:
            user = [{"type": "text", "text": user}] + ([{"type": "image"}] if rng.random() < 0.3 else [])
        msgs.append({"role": "user", "content": user})
        if t < turns - 1 or not end_with_user:
            msgs.append({"role": "assistant", "content": text(rng)})
    return msgs


def tool_conversation(rng, family):
    """A user asks, the assistant calls a tool, the tool answers, the assistant replies."""
    args = {"city": rng.choice(["Paris", "Zürich", "東京"]), "unit": "C"}
    if family.startswith("mistral"):
        call = {"id": "abc123xyz", "type": "function", "function": {"name": "get_weather", "arguments": args}}
        tool = {"role": "tool", "tool_call_id": "abc123xyz", "content": "{\"temp\": 21.5}"}
    else:
        call = {"type": "function", "function": {"name": "get_weather", "arguments": args}}
        tool = {"role": "tool", "content": rng.choice(["21.5 degrees", "{\"temp\": 21.5}", ""])}
    msgs = [{"role": "user", "content": "What is the weather?"},
            {"role": "assistant", "content": None if family.startswith(("llama", "mistral")) else "",
             "tool_calls": [call]},
            tool,
            {"role": "assistant", "content": "It is warm."}]
    if rng.random() < 0.5 and not family.startswith("mistral-v0.1"):
        msgs.insert(0, {"role": "system", "content": "Use tools when useful."})
    return msgs


def cases_for(family, rng):
    out = []
    alternating = family.startswith(("mistral", "gemma"))
    no_system = family in ("gemma2.jinja", "mistral-v0.1.jinja")
    for i in range(36):
        system = not no_system and rng.random() < 0.5
        turns = rng.randint(1, 4)
        end_with_user = rng.random() < 0.5
        msgs = plain_conversation(rng, system, turns, end_with_user, parts=family == "gemma3.jinja" and i % 5 == 4)
        out.append({"messages": msgs})
    if family.startswith(("llama", "qwen", "mistral-v0.3")):
        for i in range(8):
            ctx = {"messages": tool_conversation(rng, family)}
            if i % 2 == 0:
                ctx["tools"] = TOOLS
            out.append(ctx)
    if family.startswith("llama3.1"):  # builtin tools and a python_tag call
        out.append({"builtin_tools": ["brave_search", "wolfram_alpha"],
                    "messages": [{"role": "user", "content": "Search"},
                                 {"role": "assistant", "tool_calls": [{"function": {
                                     "name": "brave_search", "arguments": {"query": "tidal"}}}]}]})
        out.append({"messages": [{"role": "user", "content": "two calls"},
                                 {"role": "assistant", "tool_calls": [
                                     {"function": {"name": "a", "arguments": {}}},
                                     {"function": {"name": "b", "arguments": {}}}]}]})  # refused
    # the template's own refusals
    if alternating:
        out.append({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    if no_system:
        out.append({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    if family.startswith(("llama", "qwen")):
        out.append({"messages": [{"role": "user", "content": "tools without a first user message"}],
                    "tools": TOOLS} if family.startswith("llama") else {"messages": [{"role": "tool", "content": "t"}]})
    return out


# Constructs one at a time: (template, variables as JSON).  The variables are
# given to the template as they are (no messages needed).
EXPRESSIONS = [
    ("{{ s[1:] }}|{{ s[:2] }}|{{ s[:-1] }}|{{ s[1:-1] }}|{{ s[-2:] }}|{{ s[:] }}|{{ s[4:2] }}|{{ s[10:] }}|{{ s[::-1] }}|{{ s[::2] }}|{{ s[5:0:-2] }}",
     {"s": "abcdef"}),
    ("{{ u[1:3] }}|{{ u[-1] }}|{{ u|length }}|{{ u[::-1] }}|{{ u|list|length }}", {"u": "héllo 世界🙂"}),
    ("{{ items[1:] | length }}|{{ items[:-1] }}|{{ items[-1:] }}|{{ items[::-1] }}|{{ items[5] }}|{{ items[-1] }}",
     {"items": ["x", "y", "z"]}),
    ("{{ b is defined }}|{{ nope is defined }}|{{ nope is not defined }}|{{ b is not defined }}|{{ n is number }}|"
     "{{ s is string }}|{{ d is mapping }}|{{ nothing is none }}|{{ n is integer }}|{{ f is float }}|{{ t is boolean }}|"
     "{{ s is iterable }}|{{ n is iterable }}|{{ d is sequence }}|{{ items is sequence }}|{{ nope is iterable }}",
     {"b": "B", "n": 7, "s": "x", "d": {"b": 2, "a": 1}, "nothing": None, "f": 1.5, "t": True, "items": [1]}),
    ("{{ 7 % 3 }}|{{ -7 % 3 }}|{{ 7 % -3 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ 7 / 2 }}|{{ 2 - 5 }}|{{ 3 * 4 }}|{{ -1 }}|"
     "{{ 10 - -2 }}|{{ 2 ** 10 }}|{{ 2 ** -1 }}|{{ 7.5 // 2 }}|{{ -7.5 % 2 }}|{{ 1 + 2.0 }}|{{ 6 / 3 }}|{{ True + 1 }}", {}),
    ("{{ 0.1 + 0.2 }}|{{ 1e16 }}|{{ 1e15 }}|{{ 0.0001 }}|{{ 0.00001 }}|{{ 1.5e300 * 1e10 }}|{{ -0.0 }}|{{ 123456789.125 }}|"
     "{{ 1/3 }}|{{ 2.0 }}|{{ x }}|{{ y }}", {"x": 1e-07, "y": 12345678901234567890.0}),
    ("{{ nope or 'fb' }}|{{ b or 'fb' }}|{{ zero or 'fb' }}|{{ b and 'last' }}|{{ '' and 'never' }}|{{ not zero }}|"
     "{{ 'a' if zero else 'b' }}|{{ 'x' if b }}|{{ [] or none }}", {"b": "B", "zero": 0}),
    ("{{ s | length }}|{{ items | length }}|{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ items | tojson }}|"
     "{{ nested | tojson }}|{{ nested | tojson(indent=4) }}|{{ d | tojson(sort_keys=true) }}|{{ e | tojson }}|"
     "{{ d | tojson(separators=(',', ':')) }}|{{ s | tojson(ensure_ascii=true) }}",
     {"s": "héllo \"q\" \\ \n\t\u0001 🙂", "items": [1, 2.5, None, True, "é"], "d": {"b": 2, "a": 1},
      "nested": {"x": [], "y": {}, "z": [{"k": [1, {"q": None}]}]}, "e": []}),
    ("{{ '  x y  ' | trim }}|{{ '\u3000x\u00a0' | trim }}|{{ 'xxhixx' | trim('x') }}|{{ 'Hello' | upper }}|"
     "{{ 'Hello' | lower }}|{{ 'hello wORLD' | capitalize }}|{{ 'hello wORLD-x' | title }}|{{ 'a-b-c' | replace('-', '+') }}|"
     "{{ 'aaa' | replace('a', 'b', 2) }}|{{ ['a', 'b', 1] | join(', ') }}|{{ [1, 2] | join }}|{{ d | items | list }}|"
     "{{ none | default('dflt') }}|{{ nope | default('dflt') }}|{{ '' | default('dflt', true) }}|{{ nope | d('x') }}|"
     "{{ 5 | string }}|{{ [3, 1, 2] | first }}|{{ [3, 1, 2] | last }}|{{ 'abc' | first }}|{{ d | first }}",
     {"d": {"b": 2, "a": 1}}),
    ("{{ xs | selectattr('role', 'equalto', 'user') | list | length }}|{{ xs | rejectattr('role', 'equalto', 'user') | map(attribute='c') | join(',') }}|"
     "{{ xs | map(attribute='role') | unique | list }}|{{ [3, 1, 2] | sort }}|{{ [3, 1, 2] | sort(reverse=true) }}|"
     "{{ xs | sort(attribute='c') | map(attribute='c') | join }}|{{ [1, 2, 3, 4] | select('odd') | list }}|"
     "{{ [1, 2, 3, 4] | reject('even') | list }}|{{ [1, 2, 3] | sum }}|{{ [1, 2, 3] | max }}|{{ ['b', 'A', 'c'] | min }}|"
     "{{ xs | selectattr('c') | list | length }}|{{ [1, 2] | reverse | list }}|{{ 'abc' | reverse }}|{{ -3 | abs }}|"
     "{{ 2.567 | round(2) }}|{{ '42' | int }}|{{ 'x' | int(7) }}|{{ '1.5' | float }}|{{ d | dictsort }}|{{ ['a', 'a', 'B', 'b'] | unique | list }}",
     {"xs": [{"role": "user", "c": "3"}, {"role": "assistant", "c": "1"}, {"role": "user", "c": "2"}], "d": {"b": 2, "a": 1}}),
    ("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}"
     "{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('a', 'b') }};{% endfor %}",
     {"xs": ["p", "q", "r"]}),
    ("{% for x in xs if x != 'q' %}{{ loop.index }}{{ x }}{{ loop.length }}{% else %}none{% endfor %}|"
     "{% for x in [] %}never{% else %}empty{% endfor %}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|"
     "{% for k, v in d | items %}{{ k }}{{ v }}{% endfor %}|{% for x in xs %}{% if x == 'q' %}{% break %}{% endif %}{{ x }}{% endfor %}|"
     "{% for x in xs %}{% if x == 'q' %}{% continue %}{% endif %}{{ x }}{% endfor %}|{% for c in 'ab' %}{{ c }}.{% endfor %}|"
     "{% for i in range(3) %}{{ i }}{% endfor %}{% for i in range(1, 10, 3) %}{{ i }}{% endfor %}",
     {"xs": ["p", "q", "r"], "d": {"b": 2, "a": 1}}),
    ("{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = i * 10 %}{{ x }}{% endfor %}{{ x }}|"
     "{% for i in [1, 2] %}{% if i == 2 %}{{ y }}{% endif %}{% set y = i %}{% endfor %}|{{ y }}|"
     "{% set ns = namespace(total=0, seen=none) %}{% for i in [1, 2, 3] %}{% set ns.total = ns.total + i %}{% endfor %}{{ ns.total }}|"
     "{% if true %}{% set z = 'if leaks' %}{% endif %}{{ z }}|{% set a, b = [1, 2] %}{{ a }}{{ b }}|"
     "{% set block %}captured {{ 1 + 1 }}{% endset %}{{ block }}", {}),
    ("{{ 1 == 1.0 }}|{{ True == 1 }}|{{ 'a' < 'b' }}|{{ 1 < 2 < 3 }}|{{ 3 > 2 > 2 }}|{{ 'b' in 'abc' }}|{{ 2 in [1, 2] }}|"
     "{{ 'k' in d }}|{{ 'z' not in d }}|{{ [1, 2] == [1, 2] }}|{{ d == {'a': 1, 'k': 2} }}|{{ none == none }}|{{ nope == nope2 }}|"
     "{{ (1, 2) }}|{{ [1, 'a', none, true, 1.5, {'k': 'v'}] }}|{{ d }}|{{ \"it's\" }}|{{ ['it\\'s', 'a\"b', 'x\\ny'] }}",
     {"d": {"k": 2, "a": 1}}),
    ("{{ d['items'] }}|{{ d.get('a') }}|{{ d.get('zz', 'dd') }}|{{ d.keys() | list }}|{{ d.values() | list }}|"
     "{{ ' a b '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|"
     "{{ 'Hi'.upper() }}|{{ 'a-b'.replace('-', '') }}|{{ ', '.join(['x', 'y']) }}|{{ 'abcb'.find('b') }}|{{ 'abcb'.rfind('b') }}|"
     "{{ 'abcb'.count('b') }}|{{ 'x'.lstrip() }}{{ 'xyx'.rstrip('x') }}|{{ [1, 2, 2].count(2) }}|{{ [1, 2].index(2) }}",
     {"d": {"items": 3, "a": 1}}),
    ("a  \n  {% if true %}\n    yes\n  {% endif %}\n  b {{- ' c ' -}} d\n{# comment #}\n  {%- if true -%}  e  {%- endif %}\n"
     "f {%+ if true %}g{% endif %}\n    {{ 'h' }}\n{% raw %}{{ raw }} {% endraw %}\n\n", {}),
    ("{{ x }}\r\n{% if true %}\r\nline\r\n{% endif %}\n", {"x": "crlf"}),
    ("{{ 'a' ~ 1 ~ none ~ nope ~ 2.5 }}|{{ 'ab' * 3 }}|{{ [0] * 2 }}|{{ '%s' }}|{{ \"a\" 'b' }}|{{ x.0 }}|{{ 'abc'[1] }}|{{ 1_000 }}",
     {"x": ["first"]}),
    ("{{ strftime_now('%Y-%m-%d %H:%M %A %b') }}|{{ raise_exception is defined }}|{{ strftime_now is defined }}", {}),
    ("{{ t | tojson }}|{{ i | tojson }}|{{ i }}|{{ f }}|{{ big }}|{{ neg }}", {"t": [1, 2.0, 3.5e-5, -0.0, 1e100], "i": 10, "f": 3.0,
                                                                           "big": 9007199254740993, "neg": -2}),
]


def main():
    env = environment()
    rng = random.Random(20250115)
    lines = []
    for family, special in FAMILIES.items():
        with open(os.path.join(HERE, family), encoding="utf-8") as f:
            template = env.from_string(f.read())
        for ctx in cases_for(family, rng):
            for gen in (False, True):
                variables = dict(special)
                variables.update({"tools": None, "documents": None})
                variables.update(ctx)
                variables["add_generation_prompt"] = gen
                case = {"template": family, "config_json": json.dumps(special, ensure_ascii=False),
                        "context_json": json.dumps(ctx, ensure_ascii=False), "add_generation_prompt": gen}
                try:
                    case["expected"] = template.render(**variables)
                except jinja2.exceptions.TemplateError as e:
                    case["error"] = str(e)
                lines.append(json.dumps(case, ensure_ascii=False))
    for src, variables in EXPRESSIONS:
        case = {"source": src, "context_json": json.dumps(variables, ensure_ascii=False)}
        try:
            case["expected"] = env.from_string(src).render(**variables)
        except jinja2.exceptions.TemplateError as e:
            case["error"] = str(e)
        lines.append(json.dumps(case, ensure_ascii=False))
    with open(os.path.join(HERE, "cases.jsonl"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    errors = sum('"error"' in l for l in lines)
    print(f"wrote {len(lines)} cases ({errors} refused by their template) to cases.jsonl")


if __name__ == "__main__":
    main()
