"""The template limits (turbo/chat/template.py) where the last pass found them missing (issue 57):
`%` formatting, the format filter, str.format / format_map with a width or precision past
RENDER_CHARS are refused before the string is built; a filter that loops in Python over its
input's items or words (wordwrap, title, sort, map...) takes at most FILTER_ITEMS of them, so no
single call runs far past the deadline. Each refusal is one line naming the template, in seconds;
ordinary formatting renders as before."""

from __future__ import annotations

import time

import pytest

from turbo.chat.template import FILTER_ITEMS, ChatTemplate
from turbo.errors import TurboError

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("source, says", [
    ("{{ '%0999999999d' % 1 }}", "a format width or precision of 999999999"),
    ("{{ '%.999999999f' % 1.0 }}", "a format width or precision of 999999999"),
    ("{{ '%(a)0999999999d' % {'a': 1} }}", "a format width or precision of 999999999"),
    ("{{ '%(a%b)0999999999d' % {'a%b': 1} }}", "a format width or precision of 999999999"),  # (a key as Python
    ("{{ '%(a(b))0999999999d' % {'a(b)': 1} }}", "a format width or precision of 999999999"),  # reads it)
    ("{{ '%*d' % (999999999, 1) }}", "an argument of 999999999"),
    ("{{ '%0999999999d'|format(1) }}", "a format width or precision of 999999999"),
    ("{{ '{:0999999999}'.format(1) }}", "a format width or precision of 0999999999"),
    ("{{ '{:{}}'.format(1, '999999999') }}", "a format width or precision of 999999999"),
    ("{{ '{a:0999999999}'.format_map({'a': 1}) }}", "a format width or precision of 0999999999"),
    ("{{ ('a' * 30000000) | wordwrap(1) }}", "the wordwrap filter over 30000000 items"),
    ("{{ ('a ' * 3000000) | title }}", "the title filter over 6000000 items"),
    ("{{ ('a' * 3000000) | list | sort | length }}", "the sort filter over 3000000 items"),
    ("{{ ('a' * 3000000) | list | map('upper') | list | length }}", "the map filter over 3000000 items"),
    ("{{ ('<a>' * 30000) | striptags }}", "the striptags filter over 90000 items"),
])
def test_formatting_and_python_loop_filters_are_bounded(source, says):
    start = time.monotonic()
    with pytest.raises(TurboError) as e:
        ChatTemplate(source).render(MESSAGES)
    assert time.monotonic() - start < 3.0  # (before: 16 s then a MemoryError; past 60 s in wordwrap)
    assert "chat template: refused to render: " + says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_ordinary_formatting_and_filters_render_as_before():
    source = ("{{ '%5d|%%|%-3s|%.2f' % (3, 'x', 1.234) }};{{ '%(a)s' % {'a': 1} }};{{ '%03d'|format(7) }};"
              "{{ '{:>5}|{}|{a:{w}}'.format('a', 2, a='z', w=3) }};{{ '{a}'.format_map({'a': 1}) }};"
              "{{ 'a b c'|title|wordwrap(3) }};{{ [3, 1, 2]|sort|join(',') }};{{ ['a', 'b']|map('upper')|join }};"
              "{{ '<b>x</b> y'|striptags }};{{ '%d' % 1234567890123 }}")
    assert ChatTemplate(source).render(MESSAGES) == \
        "    3|%|x  |1.23;1;007;    a|2|z  ;1;A B\nC;1,2,3;AB;x y;1234567890123"
    big = "x " * FILTER_ITEMS  # C-speed filters take any size within RENDER_CHARS
    assert ChatTemplate("{{ (messages[0].content|trim|replace('x', 'y'))[:3] }}").render(
        [{"role": "user", "content": big}]) == "y y"


def test_the_format_scan_is_linear():
    """The widths are found in one pass: 200,000 unclosed mapping keys are Python's own refusal, at once."""
    start = time.monotonic()
    with pytest.raises(TurboError, match="incomplete format key"):
        ChatTemplate("{{ ('%(' * 200000) % {} }}").render(MESSAGES)
    assert time.monotonic() - start < 2.0
