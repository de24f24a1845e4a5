"""Chat templates from model files are data: rendering is sandboxed and bounded in time, memory and size."""

from __future__ import annotations

import time

import pytest

from tests._util import need

need("jinja2")

from attnkit.models.chat import TemplateLimitError, render  # noqa: E402

HI = [{"role": "user", "content": "hi"}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_an_ordinary_template_renders() -> None:
    assert render(CHATML, HI) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(("template", "message"), [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran longer than 0.5 s"),
    ("{{ 'x' * 10**9 }}", r"`\*` would build a value of about 1,000,000,000"),
    ("{{ 10 ** 100000000 }}", r"`\*\*` would build"),
    ("{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "wrote more than 1,048,576 characters"),
    ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     r"grew the process|ran longer"),
])
def test_hostile_templates_stop_at_a_bound_and_name_the_template(template: str, message: str) -> None:
    """Nested loops of 10^10 iterations hung; 'x' * 10**9 allocated gigabytes."""
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match=rf"^the chat template of evil\.gguf.*({message})"):
        render(template, HI, name="the chat template of evil.gguf", seconds=0.5, memory=64 << 20)
    assert time.monotonic() - start < 30


def test_the_sandbox_escape_through_attr_format_is_refused() -> None:
    """jinja2 3.1.5's sandbox could be escaped through |attr('format'); 3.1.6 (the floor) refuses it."""
    from jinja2.exceptions import SecurityError

    escape = "{{ '{0.__class__.__mro__[1].__subclasses__}'|attr('format')(messages) }}"
    with pytest.raises(SecurityError):
        render(escape, HI)


def test_syntax_errors_and_raise_exception_are_value_errors_naming_the_template() -> None:
    with pytest.raises(ValueError, match=r"the chat template of x.gguf does not parse: .*\(line 1\)"):
        render("{% for %}", HI, name="the chat template of x.gguf")
    with pytest.raises(ValueError, match=r"the chat template of x\.gguf refused these messages: no system role"):
        render("{{ raise_exception('no system role') }}", HI, name="the chat template of x.gguf")


def test_the_trace_is_restored_after_rendering() -> None:
    import sys

    before = sys.gettrace()
    render(CHATML, HI)
    with pytest.raises(TemplateLimitError):
        render("{{ 'x' * 10**9 }}", HI)
    assert sys.gettrace() is before
